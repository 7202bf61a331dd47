"""Any engine kind behind the engine contract: admission, deadline, accounting, failures.

:class:`EngineHost` is the one implementation of :class:`contract.EngineClient` inside
an engine replica, whatever the kind; the Serve deployment and the unit tests' fake engine both
use it, so the contract's generic rules (module docstring of ``contract``) hold the
same way for every kind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing, nullcontext
from typing import TypeVar

import msgspec

from contract import (
    Adapter,
    BacktrackEvent,
    EngineStats,
    EngineUnavailable,
    ErrorEvent,
    Event,
    FinalEvent,
    FinishReason,
    ForkEvent,
    GenerateRequest,
    InvalidPrompt,
    ModelInfo,
    Prompt,
    Timings,
    TokenEvent,
    Usage,
    splice_allowed,
    splice_refusal,
)
from engines.kit.base import Admitted, Engine, PromptError, ReferenceEngine, ReferenceOutput
from engines.kit.config import ModelConfig
from engines.kit.telemetry import LEVELS, engine_metrics
from engines.replica.admission import Refused, admit, check_prompt_size, check_request, prompt_chars
from engines.replica.offload import Busy, Offload
from engines.replica.priority_gate import PriorityGate
from engines.replica.reasoning import ReasoningFormat

__all__ = ["EngineHost"]

log = logging.getLogger(__name__)

A = TypeVar("A")
T = TypeVar("T")
Stream = AsyncIterator[Event]

# Prompts and token lists up to this size are (de)tokenized on the event loop (about a
# millisecond, less than what a thread hop costs a busy loop); larger ones on the offload thread,
# so that no prompt holds up the other streams' tokens (docs/reliability.md).
INLINE_CHARS = 1024
INLINE_TOKENS = 1024


class EngineHost:
    """:class:`~contract.EngineClient` over one :class:`~engines.kit.base.Engine`."""

    def __init__(self, engine: Engine, offload: Offload | None = None,
                 gate: PriorityGate | None = None, reasoning: ReasoningFormat | None = None):
        self.engine = engine
        # None: every admitted request goes to the engine at once (its own queue orders them).
        self.gate = gate
        # Many waiting is fine: a waiting prompt holds only itself, and its deadline bounds it.
        self.offload = offload or Offload(name="tokenize", max_waiting=256)
        self.reasoning = reasoning  # the model's reasoning format (None: it does not reason)
        self.info: ModelInfo = msgspec.structs.replace(
            engine.model_info(), reasoning=reasoning.name if reasoning is not None else None)
        self.active: set[str] = set()  # request ids in flight
        self._tags = {"model": self.info.name, "engine": self.info.engine}  # of its series
        self.aborted = 0  # requests cancelled before they finished (client disconnects)
        self.started = 0  # requests admitted to the engine (what runs each one once checks)

    @classmethod
    def for_model(cls, config: ModelConfig) -> EngineHost:
        """The host of ``config``'s engine kind, with its priority gate (``Scheduling``)."""
        from engines.kit.kinds import create_engine

        scheduling = config.scheduling
        gate = None if scheduling.max_running is None else PriorityGate(
            scheduling.max_running, scheduling.headroom)
        engine = create_engine(config)
        reasoning = None if config.reasoning is None else ReasoningFormat(
            config.reasoning.parser, engine.tokenizer, config.reasoning.budget_end)
        return cls(engine, gate=gate, reasoning=reasoning)

    async def model_info(self) -> ModelInfo:
        return self.info

    def _slot(self, priority: int) -> AbstractAsyncContextManager[None]:
        return self.gate.slot(priority) if self.gate is not None else nullcontext()

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def stats(self) -> EngineStats:
        return EngineStats(active=len(self.active), aborted=self.aborted, started=self.started)

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        """Token ids of ``prompt`` exactly as ``generate`` would see them; only a prompt that
        cannot fit the context is refused (:class:`InvalidPrompt`), before tokenizing it."""
        try:
            check_prompt_size(prompt, self.info)
            return tuple(await self._unless_busy(self._render(prompt)))
        except Refused as exc:
            raise InvalidPrompt(str(exc)) from None
        except PromptError as exc:
            raise InvalidPrompt(f"invalid prompt: {exc}") from None

    async def detokenize(self, token_ids: tuple[int, ...]) -> str:
        """Text of ``token_ids``; ids outside the vocabulary are the caller's to reject."""
        return await self._unless_busy(self._run(self.engine.detokenize, token_ids,
                                                 inline=len(token_ids) <= INLINE_TOKENS))

    async def detokenize_each(self, token_ids: tuple[int, ...]) -> tuple[str, ...]:
        def each(ids: tuple[int, ...]) -> tuple[str, ...]:
            return tuple(self.engine.detokenize((token,)) for token in ids)

        return await self._unless_busy(self._run(each, token_ids,
                                                 inline=len(token_ids) <= INLINE_TOKENS))

    def _render(self, prompt: Prompt) -> Awaitable[list[int]]:
        return self._run(self.engine.render, prompt, inline=prompt_chars(prompt) <= INLINE_CHARS)

    async def _run(self, fn: Callable[[A], T], arg: A, *, inline: bool) -> T:
        """``fn(arg)`` here when it is cheap, else on the offload thread (raises Busy)."""
        return fn(arg) if inline else await self.offload.run(fn, arg)

    async def _unless_busy(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except Busy:
            raise EngineUnavailable(self.info.name, "busy with large prompts") from None

    async def reference_greedy(self, prompt: str | list[int], max_tokens: int,
                               adapter: Adapter | None = None) -> ReferenceOutput:
        if not isinstance(self.engine, ReferenceEngine):
            raise NotImplementedError(f"the {self.info.engine} engine has no reference decoder")
        return await self.engine.reference_greedy(prompt, max_tokens, adapter)

    async def _admit(self, request: GenerateRequest) -> Admitted | ErrorEvent:
        """The request checked and its prompt rendered within its deadline, or the error event
        that refuses it: the stream then holds that event alone."""
        try:
            check_request(request, self.info)
            async with asyncio.timeout(request.timeout_s):  # the deadline covers the wait
                return admit(request, await self._render(request.prompt), self.info)
        except TimeoutError:
            return ErrorEvent(kind="overloaded", message="the deadline passed while the prompt "
                              "waited to be tokenized; retry later")
        except Refused as exc:
            return exc.event()
        except Busy:
            return ErrorEvent(kind="overloaded", message="the engine is busy tokenizing large "
                              "prompts; retry later")
        except PromptError as exc:
            return ErrorEvent(kind="validation", message=f"invalid prompt: {exc}", param="prompt")
        except Exception:  # a broken tokenizer is the engine's failure, still an event
            log.exception("rendering %s failed", request.request_id)
            return _failure(request.request_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        admitted = await self._admit(request)
        if isinstance(admitted, ErrorEvent):
            yield admitted
            return
        request, split = self._reasoning(request, admitted)
        if isinstance(request, ErrorEvent):
            yield request
            return
        request_id = request.request_id
        self.started += 1
        self.active.add(request_id)
        LEVELS.set(engine_metrics().active, self._tags, len(self.active))
        progress = _Progress(request, len(admitted.prompt_ids))
        finished = False
        try:
            # aclosing: leaving early (deadline, refusal, disconnect) closes the engine's stream
            # now, which aborts its request, instead of whenever the generator is collected.
            async with (asyncio.timeout(request.timeout_s), self._slot(request.priority),
                        aclosing(split(self.engine.stream(request, admitted))) as stream):
                async for event in stream:
                    refusal = progress.see(event)
                    if refusal is not None:  # closing the stream aborts the engine request
                        yield refusal
                        break
                    yield event
            finished = True
        except TimeoutError:  # the cancelled stream has aborted the engine request
            for event in progress.close("abort", "timeout"):
                yield event
            finished = True
        except Exception:  # the stream must still end with an event
            log.exception("engine failure on %s", request_id)
            yield _failure(request_id)
            finished = True
        finally:
            self.active.discard(request_id)
            LEVELS.set(engine_metrics().active, self._tags, len(self.active))
            if progress.reasoning_tokens:
                engine_metrics().reasoning_tokens.inc(progress.reasoning_tokens, tags=self._tags)
            # A consumer that stops pulling once it has every choice's end (the colocated
            # ingress does) closes the generator before the engine's stream is exhausted:
            # nothing was cut short then, so it is no abort.
            if not finished and progress.open:
                self.aborted += 1
            # One line per generation at DEBUG (at INFO it cost a visible share of the CPU
            # outside the engine, docs/results/benchmarks-2026-12-07.md "Observability"); Serve's access line
            # for the call carries the request's id at INFO (docs/observability.md).
            log.debug("generation %s: %s, %d prompt + %d generated tokens in %.3f s",
                     request_id, progress.outcome, progress.prompt_tokens, progress.tokens,
                     time.monotonic() - progress.started)


    def _reasoning(self, request: GenerateRequest, admitted: Admitted
                   ) -> tuple[GenerateRequest | ErrorEvent, Callable[[Stream], Stream]]:
        """The request as the engine runs it and what its stream goes through: a reasoning
        model's thinking kept apart, under the ``reasoning`` controller where the request
        bounds it or brings a controller (engines/replica/reasoning.py)."""
        fmt = self.reasoning
        if fmt is None or not fmt.thinks_after(admitted.prompt_ids):
            return request, _as_is
        steered = fmt.steer(request)
        if steered is not request and self.info.capabilities.controllers == "none":
            return ErrorEvent(kind="validation", param="reasoning", message=(
                f"model `{self.info.name}` runs no controllers, which a reasoning budget "
                "needs")), _as_is
        return steered, fmt.split


def _as_is(stream: Stream) -> Stream:
    return stream


class _Choice:
    __slots__ = ("forced", "sampled", "spliced", "tokens")

    def __init__(self, tokens: int = 0, spliced: bool = False):
        self.tokens = tokens  # in the output now
        self.forced = 0  # appended without sampling, over the run
        self.sampled = 0  # drawn by the sampler, over the run (retracted ones included)
        self.spliced = spliced


class _Progress:
    """How far each choice got, so a deadline can end the open ones with honest usage; and the
    guard that keeps splices to what the consumer renders and to what the contract allows."""

    def __init__(self, request: GenerateRequest, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.splices = request.output.splices
        self.started = time.monotonic()
        self.open = {index: _Choice() for index in range(request.sampling.n)}
        self.seen = set(self.open)  # every index used so far: a fork needs a new one
        self.tokens = 0  # every choice's, over the run
        self.reasoning_tokens = 0  # of those, a reasoning model's thinking (final counts)
        self.outcome = "aborted"  # the last finish reason or error kind (for the log)

    def see(self, event: Event) -> ErrorEvent | None:
        """Account for ``event``; an ErrorEvent to send instead when it breaks the contract."""
        if isinstance(event, TokenEvent):
            choice = self.open.get(event.index)
            if choice is None:
                return _broken(f"a token for choice {event.index}, which is not open")
            choice.tokens += 1
            self.tokens += 1
            if event.forced:
                choice.forced += 1
            else:
                choice.sampled += 1
        elif isinstance(event, FinalEvent):
            self.open.pop(event.index, None)
            self.outcome = event.finish_reason
            self.reasoning_tokens += event.usage.reasoning_tokens
        elif isinstance(event, ErrorEvent):  # ends the whole stream
            self.open.clear()
            self.outcome = event.kind
        elif isinstance(event, (BacktrackEvent, ForkEvent)):
            if not splice_allowed(event, self.splices):
                return splice_refusal(event)
            return self._splice(event)
        return None

    def _splice(self, event: BacktrackEvent | ForkEvent) -> ErrorEvent | None:
        if isinstance(event, BacktrackEvent):
            choice = self.open.get(event.index)
            if choice is None or not 0 <= event.count <= choice.tokens:
                return _broken(f"a backtrack of {event.count} tokens on choice {event.index}")
            choice.tokens -= event.count
            choice.spliced = True
            return None
        parent = self.open.get(event.parent)
        if parent is None or event.index in self.seen:
            return _broken(f"a fork of choice {event.parent} into index {event.index}")
        self.seen.add(event.index)
        self.open[event.index] = _Choice(parent.tokens, spliced=True)
        return None

    def close(self, reason: FinishReason, stop_reason: str) -> list[FinalEvent]:
        timings = Timings(ttft_s=time.monotonic() - self.started)
        return [FinalEvent(index=index, finish_reason=reason, stop_reason=stop_reason,
                           usage=Usage(prompt_tokens=self.prompt_tokens,
                                       completion_tokens=choice.tokens,
                                       forced_tokens=choice.forced,
                                       sampled_tokens=choice.sampled if choice.spliced else None),
                           timings=timings)
                for index, choice in sorted(self.open.items())]


def _broken(what: str) -> ErrorEvent:
    return ErrorEvent(kind="engine", message=f"the engine broke the stream contract: {what}")


def _failure(request_id: str) -> ErrorEvent:
    # The exception's text stays in the log: it may carry paths, addresses and remote traces.
    return ErrorEvent(kind="engine", message=f"engine failure (request {request_id}; the "
                      "engine's log has the details)")

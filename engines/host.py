"""Any engine kind behind the engine contract: admission, deadline, accounting, failures.

:class:`EngineHost` is the one implementation of :class:`protocols.internal.EngineClient` inside
an engine replica, whatever the kind; the Serve deployment and the unit tests' fake engine both
use it, so the contract's generic rules (module docstring of ``protocols.internal``) hold the
same way for every kind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from engines.admission import Refused, admit, check_request
from engines.base import Engine, PromptError, ReferenceEngine, ReferenceOutput
from protocols.internal import (
    BacktrackEvent,
    EngineStats,
    ErrorEvent,
    Event,
    FinalEvent,
    FinishReason,
    ForkEvent,
    GenerateRequest,
    ModelInfo,
    Prompt,
    Timings,
    TokenEvent,
    Usage,
    splice_allowed,
    splice_refusal,
)

__all__ = ["EngineHost"]

log = logging.getLogger(__name__)


class EngineHost:
    """:class:`~protocols.internal.EngineClient` over one :class:`~engines.base.Engine`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.info: ModelInfo = engine.model_info()
        self.active: set[str] = set()  # request ids in flight
        self.aborted = 0  # requests cancelled before they finished (client disconnects)

    async def model_info(self) -> ModelInfo:
        return self.info

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def stats(self) -> EngineStats:
        return EngineStats(active=len(self.active), aborted=self.aborted)

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        """Token ids of ``prompt`` exactly as ``generate`` would see them (no validation)."""
        return tuple(self.engine.render(prompt))

    async def detokenize(self, token_ids: tuple[int, ...]) -> str:
        """Text of ``token_ids``; ids outside the vocabulary are the caller's to reject."""
        return self.engine.detokenize(token_ids)

    async def detokenize_each(self, token_ids: tuple[int, ...]) -> tuple[str, ...]:
        return tuple(self.engine.detokenize((token,)) for token in token_ids)

    async def reference_greedy(self, prompt: str | list[int], max_tokens: int) -> ReferenceOutput:
        if not isinstance(self.engine, ReferenceEngine):
            raise NotImplementedError(f"the {self.info.engine} engine has no reference decoder")
        return await self.engine.reference_greedy(prompt, max_tokens)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        try:
            check_request(request, self.info)
            admitted = admit(request, self.engine.render(request.prompt), self.info)
        except Refused as exc:
            yield exc.event()
            return
        except PromptError as exc:
            yield ErrorEvent(kind="validation", message=f"invalid prompt: {exc}", param="prompt")
            return
        except Exception:  # a broken tokenizer is the engine's failure, still an event
            log.exception("rendering %s failed", request.request_id)
            yield _failure(request.request_id)
            return
        request_id = request.request_id
        self.active.add(request_id)
        progress = _Progress(request, len(admitted.prompt_ids))
        finished = False
        try:
            # aclosing: leaving early (deadline, refusal, disconnect) closes the engine's stream
            # now, which aborts its request, instead of whenever the generator is collected.
            async with (asyncio.timeout(request.timeout_s),
                        aclosing(self.engine.stream(request, admitted)) as stream):
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
            # A consumer that stops pulling once it has every choice's end (the colocated
            # ingress does) closes the generator before the engine's stream is exhausted:
            # nothing was cut short then, so it is no abort.
            if not finished and progress.open:
                self.aborted += 1


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

    def see(self, event: Event) -> ErrorEvent | None:
        """Account for ``event``; an ErrorEvent to send instead when it breaks the contract."""
        if isinstance(event, TokenEvent):
            choice = self.open.get(event.index)
            if choice is None:
                return _broken(f"a token for choice {event.index}, which is not open")
            choice.tokens += 1
            if event.forced:
                choice.forced += 1
            else:
                choice.sampled += 1
        elif isinstance(event, FinalEvent):
            self.open.pop(event.index, None)
        elif isinstance(event, ErrorEvent):  # ends the whole stream
            self.open.clear()
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

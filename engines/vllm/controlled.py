"""Requests with a controller on the ``vllm`` engine kind: segments, driven from the frontend.

vLLM cannot append tokens it did not sample, so a controlled request runs as *segments*, each
one vLLM request (``docs/controllers.md``). The hook inside vLLM (``controller_hook``) masks
every step and ends a segment, by allowing only its stop token (EOS), when the controller stops,
fails or asks for fast-forward or backtrack. Between segments this driver asks the runtime (side
channel, ``advance``) what the controller wants, withdraws tokens (``BacktrackEvent``), appends
forced tokens as ``TokenEvent(forced=True)``, and resubmits ``prompt + output so far``; vLLM's
prefix cache keeps that prefill cheap, and the continuation is what one pass over that prefix
gives.

The segment's last token is never reported to the controller by the hook (vLLM finishes the
request at that step). It is either the stop token the hook forced (dropped: the controller
ended the segment) or a token the model sampled (reported here with ``advance``): a sampled EOS
is an ordinary token to a controller, as in AICI, where only the controller or the token budget
ends generation.

What the controller logged and stored, in the engine's steps too, reaches the driver with each
``advance`` and goes out on the ``FinalEvent``.

Forks: a pre result with ``num_forks = n`` makes ``n - 1`` copies of the branch (the runtime's
``fork`` side op copies the controller; here the output so far), announced by ``ForkEvent`` s
before any event of theirs; every branch is a choice of its own (``index``) and runs its own
segments. Once a run has forked, its branches run as tasks feeding one bounded queue (the
runtime bounds the forks per request). A suspended branch waits until a sibling reports
variables written or ends (or a short poll: a sibling's engine steps may write one mid-segment),
then asks again; when every live branch is suspended the run ends (AICI's ``deadlock``). An
error in any branch ends the whole stream (the event contract's one ``ErrorEvent``).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec

from engines.controllers.messages import AdvanceAnswer, PreState, read
from engines.controllers.shm import ChannelError, ChannelFull, RuntimeReplyError, SideClient
from engines.detokenize import IncrementalDecoder
from protocols.internal import (
    DEADLOCK,
    BacktrackEvent,
    ErrorEvent,
    ErrorKind,
    Event,
    FinalEvent,
    FinishReason,
    ForkEvent,
    GenerateRequest,
    Timings,
    TokenEvent,
    Usage,
)
from protocols.pump import Pump

__all__ = ["ControlledRun", "Segment", "refusal"]

log = logging.getLogger(__name__)
SIDE_TIMEOUT_S = 10.0
RUNAWAY_FACTOR = 4
WAIT_POLL_S = 0.25  # a suspended branch asks again at least this often
QUEUE_EVENTS = 64  # events buffered from a forked run's branches
_seq_ids = itertools.count(1)


@dataclass
class Segment:
    """What one vLLM request of the run ended with."""

    finish: str = ""  # vLLM's finish_reason: "stop" / "length" / "abort"
    stop_reason: str | int | None = None


class _ControllerFailed(Exception):
    def __init__(self, message: str, kind: ErrorKind, param: str = "controller") -> None:
        super().__init__(message)
        self.kind = kind
        self.param = param


class _Family:
    """What a run's branches share: how many are live, which wait, and a version bumped when
    a branch reports written variables or ends (waiting branches then ask again)."""

    def __init__(self, root: str) -> None:
        self.root = root  # the request's controller id; forks are f"{root}.f<index>"
        self.unreleased = {root}  # controllers of the run the runtime may still hold
        self.live = 1
        self.version = 0
        self.waiting: set[int] = set()  # branch indices asleep in _wait since the last bump
        self.changed = asyncio.Event()
        self.indices = itertools.count(1)
        self.ready: dict[int, ControlledRun] = {}  # forked, not started (their pre is owed)

    def bump(self) -> None:
        self.version += 1
        self.waiting.clear()
        self.changed.set()
        self.changed = asyncio.Event()


class ControlledRun:
    """One controlled request. ``run_segment(prompt_ids, max_tokens, binding)`` is the engine's:
    it yields the segment's TokenEvents (the last one with ``last``) and returns through
    ``Segment`` how it ended."""

    def __init__(self, request: GenerateRequest, prompt_ids: list[int], max_tokens: int,
                 side: SideClient, tokenizer: Any, eos: int,
                 run_segment: Callable[[list[int], int, dict, Segment], AsyncIterator[Event]]):
        assert request.controller is not None
        self.request = request
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.side = side
        self.tokenizer = tokenizer
        self.eos = eos
        self.run_segment = run_segment
        self.req_id = f"{request.request_id}-{os.urandom(4).hex()}"
        self.out: list[int] = []
        self.texts: list[str] = []  # the text each output token's event added
        self.forced = 0
        self.sampled = 0  # withdrawn ones included
        self.spliced = False
        # What the controller logged, stored and spent that no event has carried yet: the
        # next token this branch emits carries it (AICI streams them with each event).
        self.logs: list[str] = []
        self.storage: list[dict] = []
        self.micros = 0
        self.cached = 0  # prompt tokens from the prefix cache, over all segments
        self.binds = 0  # segments the runtime saw the engine's hook bind
        self.carry = ""  # text of a dropped stop token's delta, for the next event
        self.pending: TokenEvent | None = None  # emitted once the next one is known
        self.started = time.monotonic()
        self.first_token: float | None = None
        self.index = 0  # the choice this branch is (0: the request's own sequence)
        self.family = _Family(self.req_id)
        self.asked_at = 0  # family.version when the last advance was sent

    async def _side(self, op: str, **fields: Any) -> dict:
        try:
            fut: Future = self.side.request(op, timeout=SIDE_TIMEOUT_S, **fields)
            return await asyncio.wrap_future(fut)
        except RuntimeReplyError as exc:
            raise _ControllerFailed(str(exc), "validation" if exc.is_user_error
                                    else "engine") from None
        except ChannelFull:
            raise _ControllerFailed("too many controller requests in flight; retry later",
                                    "overloaded") from None
        except ChannelError as exc:
            # The channel's names stay in the log, not in the client's error.
            log.error("controller runtime unreachable (%s): %s", self.req_id, exc)
            raise _ControllerFailed("controller runtime unreachable", "engine") from None

    async def _advance(self, tokens: list[int], backtrack: int = 0) -> AdvanceAnswer:
        self.asked_at = self.family.version  # what a suspended answer has seen (_wait)
        return self._state(await self._side("advance", req_id=self.req_id, tokens=tokens,
                                            backtrack=backtrack))

    def _state(self, answer: dict) -> AdvanceAnswer:
        state = read(answer, AdvanceAnswer)
        self.binds = state.binds
        if state.logs:
            self.logs.append(state.logs)
        self.storage += state.storage
        self.micros += state.micros
        if state.storage:  # a variable a sibling waits for may be among them
            self.family.bump()
        if state.error:
            raise _ControllerFailed(f"controller failed: {state.error}", "validation")
        return state

    async def stream(self) -> AsyncIterator[Event]:
        spec = self.request.controller
        assert spec is not None
        refused = refusal(self.request)
        if refused is not None:
            yield refused
            return
        try:
            try:
                # Built, and its first pre_process run, in one round trip: text the
                # controller forces at the start costs no prefill.
                state = self._state(await self._side(
                    "instantiate", req_id=self.req_id, prompt=self.prompt_ids,
                    module_id=spec.module, module_arg=spec.arg, advance=True))
            except _ControllerFailed as exc:
                yield ErrorEvent(kind=exc.kind, param=exc.param, message=str(exc))
                return
            branch = self._branch(state)
            handed = False
            try:
                async for event in branch:  # one sequence: its events as they come
                    yield event
                    if isinstance(event, ForkEvent):
                        fork = event
                        break
                else:
                    return
                handed = True  # from here _forked's task owns (and closes) it
                async with aclosing(self._forked(branch, fork.index)) as merged:
                    async for event in merged:
                        yield event
            finally:
                if not handed:  # closed now, not when collected: its segment's vLLM request
                    await branch.aclose()  # is aborted and its controller released
        finally:
            # Every controller of the run: forks whose branch never started (a protocol that
            # refused the fork, a disconnect, an error) included.
            for req_id in sorted(self.family.unreleased):
                self._release(req_id)

    def _release(self, req_id: str) -> None:
        if req_id not in self.family.unreleased:
            return
        self.family.unreleased.discard(req_id)
        try:  # no need to wait: a lost release is dropped by the runtime's idle TTL
            self.side.request("release", timeout=SIDE_TIMEOUT_S, req_id=req_id)
        except ChannelError:
            pass

    async def _branch(self, state: AdvanceAnswer | None) -> AsyncIterator[Event]:
        """This branch's events to its end; ``state`` None: a fork's, whose pre is owed."""
        try:
            if state is None:
                state = await self._advance([])
            async with aclosing(self._segments(state)) as events:  # type: ignore[type-var]
                async for event in events:
                    yield event
        except _ControllerFailed as exc:
            for event in self._flush():
                yield event
            yield ErrorEvent(kind=exc.kind, param=exc.param, message=str(exc))
        finally:
            self.family.live -= 1
            self.family.bump()  # waiting siblings check again (a deadlock, perhaps)
            if self.index:  # the request's own controller goes last, in stream()
                self._release(self.req_id)

    async def _forked(self, root: AsyncIterator[Event], first: int) -> AsyncIterator[Event]:
        """After the first fork: every branch a task feeding one bounded queue; a ForkEvent
        starts the branch it announces (so it follows that event)."""
        async with Pump[Event](QUEUE_EVENTS) as pump:
            pump.start(root)
            pump.start(self.family.ready.pop(first)._branch(None))
            async for event in pump.items():
                yield event
                if isinstance(event, ForkEvent):
                    pump.start(self.family.ready.pop(event.index)._branch(None))
                elif isinstance(event, ErrorEvent):
                    return  # ends the stream: the other branches are cancelled on the way out

    async def _segments(self, state: AdvanceAnswer) -> AsyncIterator[Event]:
        while True:
            if state.stop:  # before the budget: a stop on the last token is a stop
                for event in self._finish("eos"):
                    yield event
                return
            # Withdrawn tokens make room again; a controller that keeps withdrawing what it
            # made still ends, at 4x the budget in tokens appended.
            if len(self.out) >= self.max_tokens or \
                    self.sampled + self.forced >= RUNAWAY_FACTOR * self.max_tokens:
                for event in self._finish("length"):
                    yield event
                return
            pre = state.pre or PreState()
            if pre.suspend:
                for event in self._flush():  # a waiting branch's last token is not held back
                    yield event
                state = await self._wait()
                continue
            if pre.num_forks > 1:
                if pre.ff_tokens or pre.backtrack:
                    raise _ControllerFailed("a pre result that forks cannot also force or "
                                            "withdraw tokens on this engine", "validation")
                for event in await self._fork(pre.num_forks):
                    yield event
                state = await self._advance([])
                continue
            forced = list(pre.ff_tokens)
            backtrack = pre.backtrack
            if backtrack:
                for event in self._backtrack(backtrack):
                    yield event
            if forced:  # cut at the budget; the controller still hears of what was appended
                forced = forced[:self.max_tokens - len(self.out)]
                for token_event in self._forced(forced):
                    for event in self._hold(token_event):
                        yield event
            if forced or backtrack:
                state = await self._advance(forced, backtrack)
                continue
            segment = Segment()
            binding = {"seq": next(_seq_ids), "req_id": self.req_id}
            last: TokenEvent | None = None
            ids = self.prompt_ids + self.out
            binds, cached = self.binds, 0
            events = self.run_segment(ids, self.max_tokens - len(self.out), binding, segment)
            # closed at once when this branch is cancelled: the engine aborts the request
            async with aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    if isinstance(event, ErrorEvent):
                        for out in self._flush():
                            yield out
                        yield event
                        return
                    if isinstance(event, FinalEvent):  # prompt tokens from vLLM's prefix cache
                        cached = event.usage.cached_tokens
                    if not isinstance(event, TokenEvent):
                        continue
                    if event.last:  # the segment's last token: kept or dropped below
                        last = event
                        continue
                    for out in self._hold(event):
                        yield out
            # resubmissions rely on the prefix cache (whole blocks: 128 tokens on CPUs)
            log.debug("%s: segment of %d prompt tokens, %d from the prefix cache", self.req_id,
                      len(ids), cached)
            self.cached += cached
            if last is None:  # ended without a token (aborted)
                for event in self._finish("abort"):
                    yield event
                return
            if segment.finish == "stop" and last.token_id == self.eos:
                # The hook's forced end, or an EOS the model sampled? The runtime knows.
                state = await self._advance([])
                if self.binds == binds:  # no hook step saw it: it ended every row, or is off
                    raise _ControllerFailed("the engine's controller hook did not run this "
                                            "request", "engine")
                if state.pre is not None and state.pre.wants_edit and not state.stop:
                    # ended for forced tokens: the stop token is not output
                    self.carry += _without(last.text, self._text([last.token_id]))
                    continue
                for event in self._hold(last):
                    yield event
                if not state.stop:  # sampled: the controller sees it like any token
                    state = await self._advance([last.token_id])
                continue
            for event in self._hold(last):
                yield event
            if segment.finish == "stop":  # a stop token id of the client's
                for event in self._finish("stop_sequence", segment.stop_reason):
                    yield event
                return
            if segment.finish != "length" and len(self.out) < self.max_tokens:
                for event in self._finish("abort" if segment.finish == "abort" else "error"):
                    yield event
                return

    async def _fork(self, n: int) -> list[Event]:
        """Copies of this branch as branches of their own: the held token goes out first, so
        each copy starts from the output as its ForkEvent finds it."""
        indices = [next(self.family.indices) for _ in range(n - 1)]
        into = [f"{self.family.root}.f{i}" for i in indices]
        self.family.unreleased.update(into)  # released at the end whatever happens now
        await self._side("fork", req_id=self.req_id, into=into)
        events: list[Event] = [*self._flush()]
        for index, req_id in zip(indices, into, strict=True):
            child = copy.copy(self)
            child.index, child.req_id = index, req_id
            child.out, child.texts = list(self.out), list(self.texts)
            child.logs, child.storage, child.micros, child.cached, child.binds = [], [], 0, 0, 0
            self.family.ready[index] = child
            self.family.live += 1
            events.append(ForkEvent(index=index, parent=self.index))
        return events

    async def _wait(self) -> AdvanceAnswer:
        """Suspended: ask again once a sibling reported written variables or ended (or after
        a poll); all live branches suspended with nothing new since is a deadlock."""
        family = self.family
        if family.version == self.asked_at:  # nothing new since it said "suspend"
            if len(family.waiting) + 1 >= family.live:
                raise _ControllerFailed("deadlock: every branch of the controller is "
                                        "suspended (waiting for variables nobody will set)",
                                        "validation", DEADLOCK)
            family.waiting.add(self.index)
            try:
                await asyncio.wait_for(family.changed.wait(), WAIT_POLL_S)
            except TimeoutError:
                pass
            finally:
                family.waiting.discard(self.index)
        return await self._advance([])

    def _hold(self, event: TokenEvent) -> list[TokenEvent]:
        """Append ``event``'s token to the output and keep it back until the next one (or the
        end) says whether it is the run's last: encoders put the finish on that token."""
        self.out.append(event.token_id)
        self.sampled += not event.forced
        if self.first_token is None:
            self.first_token = time.monotonic()
        if self.carry:
            event = msgspec.structs.replace(event, text=self.carry + event.text)
            self.carry = ""
        if event.index != self.index:
            event = msgspec.structs.replace(event, index=self.index)
        self.texts.append(event.text)
        out = self._flush()
        self.pending = event
        return out

    def _flush(self, last: bool = False) -> list[TokenEvent]:
        held, self.pending = self.pending, None
        if held is None:
            return []
        if self.logs or self.storage or self.micros:
            held = msgspec.structs.replace(held, last=last, **self._notes())
        elif held.last != last:
            held = msgspec.structs.replace(held, last=last)
        return [held]

    def _notes(self) -> dict:
        """The logs, storage and micros no event carried yet, taken for one."""
        notes = {"logs": "".join(self.logs), "storage": tuple(self.storage),
                 "micros": self.micros}
        self.logs, self.storage, self.micros = [], [], 0
        return notes

    def _finish(self, reason: FinishReason,
                stop_reason: str | int | None = None) -> list[Event]:
        return [*self._flush(last=True), self._final(reason, stop_reason)]

    def _backtrack(self, count: int) -> list[Event]:
        """Withdraw the output's last ``count`` tokens (the held one goes out first: consumers
        see every token they are told to withdraw)."""
        if count > len(self.out):
            raise _ControllerFailed(f"the controller withdrew {count} tokens, but only "
                                    f"{len(self.out)} were generated", "validation")
        events: list[Event] = [*self._flush()]
        text = "".join(self.texts[-count:])
        del self.out[-count:], self.texts[-count:]
        self.carry = ""  # text held back from the withdrawn tokens
        self.spliced = True
        events.append(BacktrackEvent(index=self.index, count=count, text=text))
        return events

    def _forced(self, tokens: list[int]) -> list[TokenEvent]:
        """Their text by incremental detokenization from the output's tail (as vLLM's and
        TGI's detokenizers: an incomplete character waits for the token that completes it)."""
        events = []
        decoder = IncrementalDecoder(self.tokenizer, self.out[-6:],
                                     self.request.output.skip_special_tokens)
        for token in tokens:
            text = decoder.add(token)
            own = self._text([token]) if self.request.output.logprobs is not None else None
            self.forced += 1
            events.append(TokenEvent(index=self.index, token_id=token, text=text, forced=True,
                                     token_text=own,
                                     piece=text if self.request.output.token_pieces else None,
                                     elapsed_s=time.monotonic() - self.started))
        return events

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.request.output
                                     .skip_special_tokens)

    def _final(self, reason: FinishReason, stop_reason: str | int | None = None) -> FinalEvent:
        now = time.monotonic()
        first = self.first_token or now
        return FinalEvent(index=self.index, finish_reason=reason, stop_reason=stop_reason,
                          text=self.carry, **self._notes(),
                          usage=Usage(prompt_tokens=len(self.prompt_ids),
                                      completion_tokens=len(self.out),
                                      forced_tokens=self.forced,
                                      sampled_tokens=self.sampled if self.spliced else None,
                                      cached_tokens=self.cached),
                          timings=Timings(ttft_s=first - self.started, decode_s=now - first))


def refusal(request: GenerateRequest) -> ErrorEvent | None:
    """What a controlled request cannot be combined with here: it runs as segments, and only
    the controller or the token budget ends it."""
    s, out = request.sampling, request.output
    why = param = None
    if s.n != 1 or (s.best_of or 1) != 1:
        why, param = "a controlled request has one choice (n = 1); controllers fork instead", "n"
    elif s.stop:
        why, param = ("stop sequences cannot be combined with a controller; the controller "
                      "decides where generation stops"), "stop"
    elif out.echo or out.prompt_logprobs is not None:
        why = "echo and prompt_logprobs cannot be combined with a controller on this engine"
        param = "prompt_logprobs" if out.prompt_logprobs is not None else "echo"
    return None if why is None else ErrorEvent(kind="validation", message=why, param=param)


def _without(text: str, suffix: str) -> str:
    return text[:-len(suffix)] if suffix and text.endswith(suffix) else text


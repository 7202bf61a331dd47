"""A controlled request as segments, driven from the engine's frontend, for any engine kind.

An engine that cannot append tokens it did not sample runs a controlled request as *segments*:
each one engine request whose steps the engine's hook masks (the ``vllm`` kind's
``engines/vllm/controller_hook.py``), and which the hook ends (allowing only EOS) when the
controller stops, fails or asks for an edit. Between segments this driver asks the runtime
(``advance``) what the controller wants (``engines.controllers.driver.actions.decide``), withdraws or
forces tokens, forks or waits, and resubmits ``prompt + output so far``; the branch's events
come from ``engines.controllers.driver.output.BranchOutput``. The engine gives ``run_segment``. The
whole walk, the segment's last token, forks, suspends and deadlock: ``docs/controllers.md``,
"A controlled request on the ``vllm`` kind".
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from contract import (
    DEADLOCK,
    ErrorEvent,
    Event,
    FinalEvent,
    ForkEvent,
    GenerateRequest,
    TokenEvent,
)
from contract.pump import Pump
from engines.controllers.driver.actions import (
    ControllerFailed,
    Edit,
    Finish,
    Fork,
    Suspend,
    decide,
)
from engines.controllers.driver.output import BranchOutput
from engines.controllers.ipc.channels import RuntimeReplyError, SideClient
from engines.controllers.ipc.messages import AdvanceAnswer, read
from engines.controllers.ipc.shm import ChannelError, ChannelFull

__all__ = ["ControlledRun", "Segment", "refusal"]

log = logging.getLogger(__name__)
SIDE_TIMEOUT_S = 10.0
WAIT_POLL_S = 0.25  # a suspended branch asks again at least this often
QUEUE_EVENTS = 64  # events buffered from a forked run's branches
_seq_ids = itertools.count(1)


@dataclass
class Segment:
    """What one engine request (segment) of the run ended with, in vLLM's terms."""

    finish: str = ""  # vLLM's finish_reason: "stop" / "length" / "abort"
    stop_reason: str | int | None = None


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


@dataclass
class _Ended:
    state: AdvanceAnswer | None = None


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
        self.output = BranchOutput(request, tokenizer, len(self.prompt_ids))
        self.binds = 0  # segments the runtime saw the engine's hook bind
        self.family = _Family(self.req_id)
        self.asked_at = 0  # family.version when the last advance was sent

    @property
    def index(self) -> int:
        return self.output.index

    @property
    def out(self) -> list[int]:
        return self.output.out

    async def _side(self, op: str, **fields: Any) -> dict:
        try:
            fut: Future = self.side.request(op, timeout=SIDE_TIMEOUT_S, **fields)
            return await asyncio.wrap_future(fut)
        except RuntimeReplyError as exc:
            raise ControllerFailed(str(exc), "validation" if exc.is_user_error
                                    else "engine") from None
        except ChannelFull:
            raise ControllerFailed("too many controller requests in flight; retry later",
                                    "overloaded") from None
        except ChannelError as exc:
            # The channel's names stay in the log, not in the client's error.
            log.error("controller runtime unreachable (%s): %s", self.req_id, exc)
            raise ControllerFailed("controller runtime unreachable", "engine") from None

    async def _advance(self, tokens: list[int], backtrack: int = 0) -> AdvanceAnswer:
        self.asked_at = self.family.version  # what a suspended answer has seen (_wait)
        return self._state(await self._side("advance", req_id=self.req_id, tokens=tokens,
                                            backtrack=backtrack))

    def _state(self, answer: dict) -> AdvanceAnswer:
        state = read(answer, AdvanceAnswer)
        self.binds = state.binds
        self.output.note(state.logs, state.storage, state.micros)
        if state.storage:  # a variable a sibling waits for may be among them
            self.family.bump()
        if state.error:
            raise ControllerFailed(f"controller failed: {state.error}", "validation")
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
            except ControllerFailed as exc:
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
                if not handed:  # closed now, not when collected: its segment's engine request
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
        except ControllerFailed as exc:
            for event in self.output.flush():
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
            action = decide(state, self.output, self.max_tokens)
            if isinstance(action, Finish):
                for event in self.output.finish(action.reason):
                    yield event
                return
            if isinstance(action, Suspend):
                for event in self.output.flush():  # a waiting branch's last token goes out
                    yield event
                state = await self._wait()
            elif isinstance(action, Fork):
                for event in await self._fork(action.n):
                    yield event
                state = await self._advance([])
            elif isinstance(action, Edit):
                for event in self._edit(action):
                    yield event
                state = await self._advance(action.forced, action.backtrack)
            else:
                ended = _Ended()
                async with aclosing(self._segment(state, ended)) as events:  # type: ignore[type-var]
                    async for event in events:
                        yield event
                if ended.state is None:
                    return
                state = ended.state

    def _edit(self, edit: Edit) -> list[Event]:
        events = self.output.backtrack(edit.backtrack) if edit.backtrack else []
        for token_event in self.output.forced_events(edit.forced):
            events += self.output.hold(token_event)
        return events

    async def _segment(self, state: AdvanceAnswer, ended: _Ended) -> AsyncIterator[Event]:
        """One engine request from the output so far; ``ended.state`` is the controller's state
        after it (``state`` when nothing changed it), or None when the branch ended with it."""
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
                    for out in self.output.flush():
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
                for out in self.output.hold(event):
                    yield out
        # resubmissions rely on the prefix cache (whole blocks: 128 tokens on CPUs)
        log.debug("%s: segment of %d prompt tokens, %d from the prefix cache", self.req_id,
                  len(ids), cached)
        self.output.cached += cached
        if last is None:  # ended without a token (aborted)
            for event in self.output.finish("abort"):
                yield event
            return
        if segment.finish == "stop" and last.token_id == self.eos:
            async for event in self._after_eos(last, binds, ended):
                yield event
            return
        for event in self.output.hold(last):
            yield event
        if segment.finish == "stop":  # a stop token id of the client's
            for event in self.output.finish("stop_sequence", segment.stop_reason):
                yield event
        elif segment.finish != "length" and len(self.out) < self.max_tokens:
            for event in self.output.finish("abort" if segment.finish == "abort" else "error"):
                yield event
        else:
            ended.state = state  # the budget's end, which the next decision sees

    async def _after_eos(self, last: TokenEvent, binds: int,
                         ended: _Ended) -> AsyncIterator[Event]:
        """A segment that ended on EOS: the hook's forced end, or an EOS the model sampled?
        The runtime knows."""
        state = await self._advance([])
        if self.binds == binds:  # no hook step saw it: it ended every row, or is off
            raise ControllerFailed("the engine's controller hook did not run this request",
                                    "engine")
        if state.pre is not None and state.pre.wants_edit and not state.stop:
            # ended for forced tokens: the stop token is not output
            self.output.carry += _without(last.text, self.output.text([last.token_id]))
        else:
            for event in self.output.hold(last):
                yield event
            if not state.stop:  # sampled: the controller sees it like any token
                state = await self._advance([last.token_id])
        ended.state = state

    async def _fork(self, n: int) -> list[Event]:
        """Copies of this branch as branches of their own: the held token goes out first, so
        each copy starts from the output as its ForkEvent finds it."""
        indices = [next(self.family.indices) for _ in range(n - 1)]
        into = [f"{self.family.root}.f{i}" for i in indices]
        self.family.unreleased.update(into)  # released at the end whatever happens now
        await self._side("fork", req_id=self.req_id, into=into)
        events: list[Event] = [*self.output.flush()]
        for index, req_id in zip(indices, into, strict=True):
            child = copy.copy(self)
            child.req_id, child.binds = req_id, 0
            child.output = self.output.fork(index)
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
                raise ControllerFailed("deadlock: every branch of the controller is "
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


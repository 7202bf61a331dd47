"""The runtime's side channel: a controller's life from ``instantiate`` to ``release``, and the
tag registry (``docs/protocols/controller-runtime.md``).

Beyond the seed, ``advance``, ``fork`` and ``release`` let the engine's frontend carry out what
vLLM cannot do inside a step (fast-forward, forks; ``engines/controllers/driver/run.py``). A controller
lives by its ``req_id`` from ``instantiate`` until ``release``; the engine binds it to a sequence
id per segment (``pre_ops``) and frees that id when the segment ends, and between segments the
frontend calls ``advance``: ``post_process`` of the tokens appended outside the engine (forced
ones, or the segment's last sampled token, which the engine never reported), then the
``pre_process`` still owed. Each ``pre_process`` runs once per ``post_process`` (the seed's step
order), whoever triggers it.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from engines.controllers.api.base import ControllerContext, ControllerError, Variables
from engines.controllers.ipc.channels import error_reply, ok_reply
from engines.controllers.ipc.messages import (
    LOCAL,
    Advance,
    AdvanceAnswer,
    BadMessage,
    Failure,
    Fork,
    Forked,
    GetStats,
    GetTags,
    Instantiate,
    Journal,
    MkModule,
    Ok,
    Release,
    Released,
    Reply,
    SetTags,
    SideCommand,
    read,
)
from engines.controllers.runtime.sequence import ControlledSequence, tell_branches

if TYPE_CHECKING:
    from engines.controllers.runtime.runtime import ControllerRuntime

__all__ = ["SideChannel"]

Answerer = Callable[[Reply], None]
T = TypeVar("T")


class SideChannel:
    """Answers the side channel's requests for ``runtime``, whose controllers it creates,
    forks and releases (under the runtime's lock: the main channel's thread reads them)."""

    def __init__(self, runtime: ControllerRuntime) -> None:
        self.rt = runtime
        self.limits = runtime.limits
        # Driver-side calls (instantiate, advance) wait on controller calls in the runtime's
        # pool: their own threads, so a busy pool cannot deadlock them.
        self._pool = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="aici-side")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def handle(self, request: dict, reply: Answerer) -> None:
        try:
            command = read(request, SideCommand)
        except BadMessage as exc:
            reply(error_reply(str(exc), is_user_error=True))
            return
        match command:
            case Instantiate():
                # Building a controller may compile a grammar: off the side channel's thread,
                # so other side requests are answered meanwhile (out of order, by $rid).
                self._start_instantiate(command, reply)
            case GetTags():
                reply(self.rt.tags.get_tags())
            case GetStats():
                reply(ok_reply(self.rt.stats()))
            case SetTags():
                self._answer(reply, self._set_tags, command)
            case Advance():
                self._pool.submit(self._answer, reply, self.advance, command)
            case Release():
                self._pool.submit(self._answer, reply, self._release, command)
            case Fork():
                self._pool.submit(self._answer, reply, self._fork, command)
            case MkModule():
                reply(error_reply("uploading Wasm modules is not supported by this runtime; "
                                  "use one of the built-in controllers "
                                  f"({', '.join(self.rt.tags.names())})", is_user_error=True))

    def _answer(self, reply: Answerer, handler: Callable[[T], Reply], command: T) -> None:
        try:
            reply(handler(command))
        except BadMessage as exc:
            reply(error_reply(str(exc), is_user_error=True))
        except Exception as exc:  # answered, so the frontend never waits out its timeout
            reply(error_reply(f"{type(exc).__name__}: {exc}"))

    def _set_tags(self, command: SetTags) -> Reply:
        return self.rt.tags.set_tags(command, command.auth or LOCAL)

    def _controller(self, req_id: object) -> ControlledSequence | Failure:
        with self.rt.lock:
            seq = self.rt._live.get(req_id) if isinstance(req_id, str) else None
        return seq or error_reply(f"no controller for req_id {req_id!r}", is_user_error=True)

    def advance(self, advance: Advance) -> Reply:
        """Between segments: ``post_process(tokens, backtrack)`` when given, then the
        ``pre_process`` owed. Answers the sequence's state: ``stop``, ``error`` and the pending
        ``pre`` result (``suspend`` / ``num_forks`` / ``ff_tokens``; None once stopped), plus
        the ``logs`` and ``storage`` of every call since the previous ``advance``."""
        seq = self._controller(advance.req_id)
        if isinstance(seq, Failure):
            return seq
        tokens, backtrack = advance.tokens or [], advance.backtrack or 0
        with self.rt.lock:
            # The engine is done with the segment, though its ``freed`` may come later:
            # from here its steps leave this controller alone.
            self.rt.unbind(seq, seq.bound_to)
        error = seq.failed
        seq.touched = time.monotonic()  # a branch that only waits is not idle
        if seq.suspended:  # asked again: what it waits for may have come meanwhile
            seq.need_pre = True
        if not error and not seq.stopped and (tokens or backtrack):
            call = functools.partial(seq.controller.post_process, list(tokens), backtrack)
            error = self.rt.run_post({0: (seq, call)})[0].error
        if not error and not seq.stopped and seq.need_pre:
            error = self.rt.run_pre({0: (seq, seq.controller.pre_process)})[0].error
        seq.ctx.drain()  # this call's entries are in the journal too
        logs, storage = seq.ctx.journal()  # since the last advance: the segment's steps too
        micros, seq.micros = seq.micros, 0
        return ok_reply(AdvanceAnswer(
            stop=seq.stopped, error=error or seq.failed, binds=seq.binds,
            pre=None if seq.stopped or error else seq.last_pre,
            logs=logs, storage=storage, micros=micros))

    def _release(self, release: Release) -> Reply:
        req_id = release.req_id
        with self.rt.lock:
            seq = self.rt._live.pop(req_id, None) if isinstance(req_id, str) else None
            self.rt.unbind(seq, seq.bound_to if seq is not None else None)
            if seq is not None:
                seq.family.discard(seq.req_id)
        return ok_reply(Released(seq is not None))

    def _fork(self, fork: Fork) -> Reply:
        """Beyond the seed, for engines that fork outside the engine (the frontend runs each
        branch as its own sequence): the controller whose pending pre result asked for
        ``num_forks = n`` is copied under the ``n - 1`` req_ids in ``into`` (branches 1..n-1;
        it stays branch 0). The copies share its variables; every branch owes a pre_process,
        which its next ``advance`` runs."""
        seq = self._controller(fork.req_id)
        if isinstance(seq, Failure):
            return seq
        into = fork.into
        if not into or not all(into) or len(set(into)) != len(into):
            return error_reply("'into' is a list of distinct new req_ids", is_user_error=True)
        asked = seq.last_pre.num_forks if seq.last_pre is not None else 1
        if seq.failed or seq.stopped or asked != len(into) + 1:
            return error_reply(f"controller {seq.req_id!r} did not ask for {len(into) + 1} "
                               f"forks", is_user_error=True)
        children = [seq.fork(req_id) for req_id in into]
        with self.rt.lock:  # checked and taken at once: sibling branches may fork meanwhile
            live = self.rt._live
            if any(r in live for r in into):
                return error_reply("a req_id in 'into' is already instantiated",
                                   is_user_error=True)
            if len(live) + len(into) > self.limits.max_pending:
                return error_reply("too many live controllers; retry later")
            if len(seq.family) + len(into) > self.limits.max_forks:
                return error_reply(f"{len(seq.family) + len(into)} forks exceed the limit of "
                                   f"{self.limits.max_forks} per request", is_user_error=True)
            for child in children:
                live[child.req_id] = child
                seq.family.add(child.req_id)
        tell_branches(seq, children)
        for branch in (seq, *children):
            branch.need_pre, branch.last_pre = True, None
        return ok_reply(Forked(into))

    def _start_instantiate(self, instantiate: Instantiate, reply: Answerer) -> None:
        """Answer with the controller built, or with a timeout after ``Limits.init_s``,
        whichever comes first; a controller finished after its timeout is dropped. With
        ``advance: true`` the answer is the first ``advance``'s (its pre result)."""
        first = threading.Lock()

        def expire() -> None:
            if first.acquire(blocking=False):
                reply(error_reply(f"controller initialization took longer than "
                                  f"{self.limits.init_s * 1000:g} ms", is_user_error=True))

        def build() -> None:
            answer = self._instantiate(instantiate, first)
            timer.cancel()
            if isinstance(answer, Ok) and instantiate.advance:
                # Beyond the seed: the first ``advance`` in the same answer (one round trip
                # less before a controlled request's prefill).
                try:
                    answer = self.advance(Advance(req_id=instantiate.req_id))
                except Exception as exc:  # answered, so the frontend never waits out a timeout
                    answer = error_reply(f"{type(exc).__name__}: {exc}")
            if answer is not None:
                reply(answer)

        timer = threading.Timer(self.limits.init_s, expire)
        timer.daemon = True
        timer.start()
        self._pool.submit(build)

    def _instantiate(self, request: Instantiate, first: threading.Lock) -> Reply | None:
        """The answer, or None when the timeout answered first (nothing is kept then)."""
        answer = self._build(request)
        if not isinstance(answer, ControlledSequence):
            return answer if first.acquire(blocking=False) else None
        req_id = request.req_id
        now = time.monotonic()
        with self.rt.lock:
            if not first.acquire(blocking=False):
                return None
            live = self.rt._live
            # Controllers nobody released (their frontend died): dropped when idle that long.
            for key in [k for k, p in live.items() if p.bound_to is None
                        and now - p.touched > self.limits.pending_ttl_s]:
                del live[key]
            if len(live) >= self.limits.max_pending:
                return error_reply("too many live controllers; retry later")
            if req_id in live:
                return error_reply(f"req_id {req_id!r} is already instantiated",
                                   is_user_error=True)
            live[req_id] = answer
        logs, storage = answer.ctx.drain()
        return ok_reply(Journal(logs, storage))

    def _build(self, request: Instantiate) -> Failure | ControlledSequence:
        req_id, module = request.req_id, request.module_id
        arg, prompt = request.module_arg, request.prompt
        if not isinstance(req_id, str) or not req_id:
            return error_reply("'req_id' is a non-empty string", is_user_error=True)
        factory = self.rt.tags.factory(module)
        if factory is None:
            return error_reply(f"unknown controller {module!r}; known: "
                               f"{', '.join(sorted(self.rt.tags.names()))}", is_user_error=True)
        if arg is None:
            arg = ""
        elif not isinstance(arg, str):
            arg = json.dumps(arg)
        if isinstance(prompt, str):
            prompt = self.rt.tokenizer.encode(prompt)
        if len(arg) > self.limits.max_arg_bytes or len(prompt) > self.limits.max_arg_bytes:
            return error_reply(f"controller argument or prompt over "
                               f"{self.limits.max_arg_bytes} bytes", is_user_error=True)
        ctx = ControllerContext(self.rt.tokenizer, Variables(), self.rt.tags.factory)
        try:
            controller = factory(ctx, arg, list(prompt))
        except ControllerError as exc:
            return error_reply(str(exc), is_user_error=True)
        except Exception as exc:  # the request's controller failed, not the runtime: the
            # client's error (AICI's ``fail`` in the stream, elsewhere a validation error), as
            # docs/controllers.md says, not an engine failure (HTTP 500 on /v1/run)
            return error_reply(f"{type(exc).__name__}: {exc}", is_user_error=True)
        return ControlledSequence(req_id, controller, ctx, [])

"""The controller runtime: the seed's commands, answered for the live controllers of one engine.

``ControllerRuntime.handle_main`` answers the main channel (``ping``, ``tokens``,
``post_pre_process``, ``mid_process``) and ``handle_side`` the side channel (``instantiate``,
``set_tags``, ``get_tags``, ``mk_module``) exactly in the seed's JSON shapes
(``docs/protocols/controller-runtime.md``); ``engines/controllers/shm.py`` carries them. The
runtime knows nothing of Ray or vLLM, so it is tested directly and over shared memory.

Time bounds (aicirt's, ``docs/protocols/aici.md``, "Time bounds"): every controller call runs on a worker
thread and may use ``Limits.step_s`` of CPU time, within ``Limits.wall_factor`` times that of
wall time (``ControllerRuntime._run`` says why CPU time). A ``mid_process`` that overruns
leaves its row all-allowed (a no-op step, logged), and ``Limits.max_timeout_steps`` of those in a
row fail the sequence; ``pre_process`` / ``post_process`` change the controller's state, so one
that overruns fails the sequence at once (its late effect could not be undone). A call still
running from an earlier step is not started again: that step counts as another timeout. Each
phase of a step (post, pre, mid) waits at most the wall cap.

Beyond the seed, two side ops let the engine's frontend carry out what vLLM cannot do inside a
step (fast-forward; ``engines/vllm/controlled.py``). A controller lives by its ``req_id`` from
``instantiate`` until ``release``; the engine binds it to a sequence id per segment (``pre_ops``)
and frees that id when the segment ends, and between segments the frontend calls ``advance``:
``post_process`` of the tokens appended outside the engine (forced ones, or the segment's last
sampled token, which the engine never reported), then the ``pre_process`` still owed. Each
``pre_process`` runs once per ``post_process`` (the seed's step order), whoever triggers it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.controllers.base import (
    Controller,
    ControllerContext,
    ControllerError,
    PreResult,
    TokenizerInfo,
    Variables,
)
from engines.controllers.shm import BiasMatrix, error_reply, ok_reply, row_ends
from protocols.controller_tags import MAX_USER_TAGS, check_tags

__all__ = ["ControllerFactory", "ControllerRuntime", "Limits", "module_id_of"]

ControllerFactory = Callable[[ControllerContext, str, list[int]], Controller]


@dataclass(frozen=True)
class Limits:
    step_s: float = 0.025  # aicirt's --wasm-max-step-time default: CPU time of one call
    # ... and, however a call spends it (blocked, or waiting for a core or the GIL), this many
    # times that in wall time
    wall_factor: float = 4.0
    init_s: float = 1.0  # --wasm-max-init-time
    max_timeout_steps: int = 10  # --wasm-max-timeout-steps
    max_forks: int = 16  # --wasm-max-forks, per request
    max_arg_bytes: int = 1 << 20  # controller_arg, and the prompt as given
    max_pending: int = 1024  # live controllers (instantiated, not yet released)
    pending_ttl_s: float = 600.0  # one idle (no segment running) this long is dropped
    workers: int = 8


def module_id_of(factory: ControllerFactory) -> str:
    """A built-in's module id: sha256 hex, like a Wasm module's, of its import path."""
    path = f"{factory.__module__}:{getattr(factory, '__qualname__', repr(factory))}"
    return hashlib.sha256(path.encode()).hexdigest()


class _Seq:
    __slots__ = ("binds", "bound_to", "controller", "ctx", "failed", "family", "forks",
                 "last_pre", "micros", "need_pre", "req_id", "running", "stopped", "timeouts",
                 "touched")

    def __init__(self, req_id: str, controller: Controller, ctx: ControllerContext,
                 forks: list[int], family: set[str] | None = None) -> None:
        self.req_id = req_id
        self.controller = controller
        self.ctx = ctx
        self.forks = forks  # ids of the request's live sequences, shared by its forks
        # req_ids of the request's live controllers (the frontend's forks, ``fork`` side op),
        # shared by them: the fork limit counts these too
        self.family = family if family is not None else {req_id}
        self.running: Future | None = None
        self.timeouts = 0
        self.failed = ""
        self.stopped = False
        self.need_pre = True  # a post_process (or the start) since the last pre_process
        self.last_pre: dict | None = None  # that pre_process's result, until the next post
        self.bound_to: int | None = None  # the engine's sequence id while a segment runs
        self.binds = 0  # segments the engine bound: the frontend checks its hook ran
        self.touched = time.monotonic()
        self.micros = 0  # time its calls ran since the last ``advance`` reported it



class ControllerRuntime:
    def __init__(self, tokenizer: TokenizerInfo, controllers: dict[str, ControllerFactory],
                 bias: BiasMatrix | None = None, limits: Limits = Limits()) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self._bias = bias
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="aici-ctrl")
        self._lock = threading.Lock()  # _pending and _tags: the side channel's thread too
        self._modules: dict[str, ControllerFactory] = {}
        self._tags: dict[str, dict] = {}
        self._live: dict[str, _Seq] = {}  # every controller, from instantiate to release
        self._seqs: dict[int, _Seq] = {}  # the engine's sequence ids bound to them
        # Driver-side calls (instantiate, advance) wait on controller calls in _pool: their own
        # threads, so a busy _pool cannot deadlock them.
        self._side_pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="aici-side")
        started = int(time.time())
        self._builtin = frozenset(controllers)  # tags nobody may set (check_tags)
        for tag, factory in controllers.items():
            module_id = module_id_of(factory)
            self._modules[module_id] = factory
            self._tags[tag] = {"tag": tag, "module_id": module_id, "updated_at": started,
                               "updated_by": "builtin", "wasm_size": 0, "compiled_size": 0}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._side_pool.shutdown(wait=False, cancel_futures=True)

    # --- main channel -----------------------------------------------------------------------

    def handle_main(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "ping":
            return ok_reply({"pong": 1})
        if op == "tokens":
            return ok_reply({"vocab_size": self.tokenizer.vocab_size})
        if op == "post_pre_process":
            return ok_reply(self._post_pre_process(cmd.get("post_ops") or [],
                                                   cmd.get("pre_ops") or [],
                                                   cmd.get("freed") or []))
        if op == "mid_process":
            return ok_reply(self._mid_process(cmd.get("ops") or []))
        if op == "step":
            return ok_reply(self._step(cmd))
        return error_reply(f"unknown main-channel op {op!r}", is_user_error=True)

    def _step(self, cmd: dict) -> dict:
        """Beyond the seed: ``post_pre_process`` then ``mid_process`` in one round trip (as
        AICI's ABI v2 merged its phases). ``mid_ops`` lists every row the engine may sample;
        those the first half ends (``row_ends``) get no mask; ``mid.ids`` gives the bias rows'
        order."""
        data = self._post_pre_process(cmd.get("post_ops") or [], cmd.get("pre_ops") or [],
                                      cmd.get("freed") or [])
        post, pre = data["post_seqs"], data["pre_seqs"]
        ops = [op for op in cmd.get("mid_ops") or []
               if not row_ends(post.get(str(op["id"])), pre.get(str(op["id"])))]
        mid = self._mid_process(ops, bits=cmd.get("mask_format") == "bits")
        mid["ids"] = [int(op["id"]) for op in ops]
        return {**data, "mid": mid}

    def _post_pre_process(self, post_ops: list, pre_ops: list, freed: list) -> dict:
        pre: dict[str, dict] = {}
        with self._lock:
            for seq_id in freed:
                self._unbind(self._seqs.get(int(seq_id)), int(seq_id))
            # Bound before the posts: a request vLLM preempted and resumed is bound again
            # in the step that reports the tokens it sampled meanwhile.
            for op in pre_ops:
                seq_id, req_id = int(op["id"]), str(op["req_id"])
                seq = self._live.get(req_id)
                if seq is None:
                    pre[str(seq_id)] = _record(None, None, f"no instantiated controller for "
                                                           f"{req_id!r}", 0)
                elif seq_id in self._seqs or seq.bound_to is not None:
                    pre[str(seq_id)] = _record(None, None, f"sequence {seq_id} or controller "
                                                           f"{req_id!r} is already bound", 0)
                else:
                    seq.bound_to = seq_id
                    seq.binds += 1
                    seq.forks.append(seq_id)
                    self._seqs[seq_id] = seq
        post: dict[str, dict] = {}
        calls = {}
        for op in post_ops:
            seq_id = int(op["id"])
            seq = self._seqs.get(seq_id)
            if seq is None:
                post[str(seq_id)] = _record(None, None, f"unknown sequence {seq_id}", 0)
                continue
            if seq.failed or seq.stopped:
                continue
            tokens, backtrack = list(op.get("tokens") or []), int(op.get("backtrack") or 0)
            calls[seq_id] = (seq, functools.partial(seq.controller.post_process, tokens, backtrack))
        for seq_id, (_, error, micros) in self._run_post(calls).items():
            seq = calls[seq_id][0]  # the side thread may have released it meanwhile
            post[str(seq_id)] = _record(seq, None if error else {"stop": seq.stopped}, error,
                                        micros)
        with self._lock:
            # Only sequences the engine runs now; one the frontend is advancing is unbound.
            # A suspended sequence asks again every step (a sibling may have set what it
            # waits for); it was not scheduled, so no post_process made a pre due.
            calls = {seq_id: (seq, seq.controller.pre_process)
                     for seq_id, seq in self._seqs.items()
                     if seq.bound_to == seq_id and (seq.need_pre or _suspended(seq))
                     and not (seq.failed or seq.stopped)}
        for seq_id, (value, error, micros) in self._run_pre(calls).items():
            seq = calls[seq_id][0]
            pre[str(seq_id)] = _record(seq, None if error else value, error, micros)
        return {"post_seqs": post, "pre_seqs": pre}

    def _unbind(self, seq: _Seq | None, seq_id: int | None) -> None:
        """Under ``_lock``: the engine's ``seq_id`` no longer runs ``seq``."""
        if seq is None or seq_id is None:
            return
        if self._seqs.get(seq_id) is seq:
            del self._seqs[seq_id]
        if seq_id in seq.forks:
            seq.forks.remove(seq_id)
        if seq.bound_to == seq_id:
            seq.bound_to = None

    def _run_post(self, calls: dict) -> dict[Any, tuple[Any, str, int]]:
        out = self._run(calls, stateful=True)
        for key, (value, error, _) in out.items():
            seq = calls[key][0]
            seq.stopped = bool(value) and not error
            seq.need_pre, seq.last_pre, seq.touched = True, None, time.monotonic()
        return out

    def _run_pre(self, calls: dict) -> dict[Any, tuple[Any, str, int]]:
        """``value`` becomes the seed's pre result (a dict) or an error."""
        out = {}
        for key, (value, error, micros) in self._run(calls, stateful=True).items():
            seq = calls[key][0]
            seq.need_pre = False
            result = None
            if not error and not isinstance(value, PreResult):
                error = seq.failed = f"pre_process returned {type(value).__name__}, not PreResult"
            elif not error:
                if not isinstance(value.backtrack, int) or value.backtrack < 0:
                    error = f"backtrack must be a count of tokens >= 0, got {value.backtrack!r}"
                    seq.failed = error
                elif value.num_forks > 1 and _live_forks(seq) - 1 + value.num_forks > \
                        self.limits.max_forks:
                    error = (f"{_live_forks(seq) - 1 + value.num_forks} forks exceed the limit "
                             f"of {self.limits.max_forks} per request")
                    seq.failed = error
                else:
                    result = value.to_json()
                    seq.stopped = value.num_forks == 0
            seq.last_pre = result
            out[key] = (result, error, micros)
        return out

    def _mid_process(self, ops: list, bits: bool = False) -> dict:
        """The seed's dense float rows, or (``bits``, beyond the seed) allowed-token bitmasks."""
        vocab = self.tokenizer.vocab_size
        rows = None
        if self._bias is not None:
            rows = self._bias.words(len(ops), vocab) if bits else self._bias.rows(len(ops), vocab)
            rows[:] = 0xFFFFFFFF if bits else 0.0
        apply = _pack_allowed if bits else _apply_allowed
        seqs: dict[str, dict] = {}
        calls = {}
        # The seed's forks: a row with ``clone_id`` new to us is a copy of that parent. Every
        # copy is made before any branch learns its index (the parent leaves its fork step
        # when told it is branch 0), and before any row's mid_process.
        clones: dict[int, list[_Seq]] = {}  # parent id → branches made of it in this call
        for op in ops:
            seq_id, clone_id = int(op["id"]), op.get("clone_id")
            if clone_id is None or seq_id in self._seqs:
                continue
            parent = self._seqs.get(int(clone_id))
            if parent is None:
                seqs[str(seq_id)] = _record(None, None, f"unknown parent {clone_id}", 0)
                continue
            child = _copy(parent, parent.req_id)
            child.bound_to = seq_id
            parent.forks.append(seq_id)
            self._seqs[seq_id] = child
            clones.setdefault(int(clone_id), []).append(child)
        for parent_id, group in clones.items():
            _tell_branches(self._seqs[parent_id], group)
        for i, op in enumerate(ops):
            seq_id = int(op["id"])
            if str(seq_id) in seqs:  # its parent was unknown
                continue
            seq = self._seqs.get(seq_id)
            if seq is None:
                seqs[str(seq_id)] = _record(None, None, f"unknown sequence {seq_id}", 0)
            elif seq.failed:
                seqs[str(seq_id)] = _record(seq, None, seq.failed, 0)
            else:
                calls[i] = (seq, seq.controller.mid_process)
        unmasked = []
        for i, (value, error, micros) in self._run(calls, stateful=False).items():
            seq = calls[i][0]
            if not error and value is None:
                unmasked.append(i)
            if not error and value is not None and rows is not None:
                try:
                    apply(rows[i], value)
                except (TypeError, ValueError) as exc:
                    error = seq.failed = f"mid_process returned an unusable mask: {exc}"
            seqs[str(ops[i]["id"])] = _record(seq, None, error, micros)
        del rows  # no view of the bias buffer outlives the step
        # Beyond the seed: rows left all-zero, which an engine that knows this may skip (the
        # rows are written all the same, for engines that do not).
        return {"seqs": seqs, "num_seqs": len(ops), "unmasked": sorted(unmasked)}

    def _run(self, calls: dict[Any, tuple[_Seq, Callable[[], Any]]],
             stateful: bool) -> dict[Any, tuple[Any, str, int]]:
        """Run each call on the pool; a call is cut once it used ``step_s`` of CPU time, or
        when ``wall_factor * step_s`` of wall time passed since the step began.

        CPU time, not wall time, is a controller's own: aicirt runs each sequence in a
        process of its own, here they share one (and its GIL), and the engine sends a step
        before its forward pass so the runtime works while the engine computes, on cores that
        the forward pass and vLLM's other processes also want. A wall bound alone charged a
        controller for the others' time and for the box's load (at 16 llguidance streams
        some overran 25 ms, had an unconstrained step and failed); the wall cap still bounds a
        controller that blocks instead of computing."""
        out: dict[Any, tuple[Any, str, int]] = {}
        futures: dict[Any, Future] = {}
        clocks: dict[Any, list] = {}
        began = time.monotonic()
        for key, (seq, call) in calls.items():
            if seq.running is not None and not seq.running.done():
                out[key] = self._timed_out(seq, stateful, still_running=True)
                continue
            if _is_default(call):  # the base class's no-op: no thread handoff for nothing
                out[key] = (_timed(call)[0], "", 0)
                continue
            clocks[key] = []
            seq.running = futures[key] = self._pool.submit(_timed, call, clocks[key])
        if futures:
            self._wait(futures, clocks, began)
        for key, fut in futures.items():
            seq = calls[key][0]
            if not fut.done():
                out[key] = self._timed_out(seq, stateful, still_running=False)
                continue
            seq.running = None
            seq.timeouts = 0
            value, error, micros = fut.result()
            seq.micros += micros
            if error:
                seq.failed = error
            out[key] = (value, error, micros)
        return out

    def _wait(self, futures: dict[Any, Future], clocks: dict[Any, list], began: float) -> None:
        """Until every call is done, over its CPU budget, or the step's wall cap passed."""
        step = self.limits.step_s
        cap = began + step * self.limits.wall_factor
        wait_all(futures.values(), timeout=step)  # most steps end here
        while True:
            within = [fut for key, fut in futures.items()
                      if not fut.done() and _cpu_used(clocks[key]) < step]
            now = time.monotonic()
            if not within or now >= cap:
                return
            wait_all(within, timeout=min(step / 4, cap - now))

    def _timed_out(self, seq: _Seq, stateful: bool, still_running: bool) -> tuple[Any, str, int]:
        bound, micros = f"{self.limits.step_s * 1000:g} ms", int(self.limits.step_s * 1e6)
        seq.micros += micros
        if stateful:
            seq.failed = f"controller step took longer than {bound}"
            return None, seq.failed, micros
        seq.timeouts += 1
        if seq.timeouts >= self.limits.max_timeout_steps:
            seq.failed = (f"controller took longer than {bound} in "
                          f"{seq.timeouts} steps in a row")
            return None, seq.failed, micros
        seq.ctx.log(f"timeout: mid_process {'still running' if still_running else 'over'} "
                    f"{bound}; this step is unconstrained")
        return None, "", micros

    # --- side channel -----------------------------------------------------------------------

    def handle_side(self, request: dict, reply: Callable[[dict], None]) -> None:
        op = request["op"]
        auth = request.get("$auth") or {"user": "localhost", "is_admin": True}
        if op == "instantiate":
            # Building a controller may compile a grammar: off the side channel's thread, so
            # other side requests are answered meanwhile (out of order, by $rid).
            self._start_instantiate(request, reply)
        elif op == "get_tags":
            with self._lock:
                tags = sorted(self._tags.values(), key=lambda t: t["updated_at"], reverse=True)
            reply(ok_reply({"tags": tags}))
        elif op == "set_tags":
            reply(self._set_tags(request, auth))
        elif op in ("advance", "release", "fork"):
            handler = {"advance": self._advance, "release": self._release,
                       "fork": self._fork}[op]
            self._side_pool.submit(self._answer, reply, handler, request)
        elif op == "mk_module":
            reply(error_reply("uploading Wasm modules is not supported by this runtime; use "
                              f"one of the built-in controllers ({', '.join(self._tags)})",
                              is_user_error=True))
        else:
            reply(error_reply(f"unknown side-channel op {op!r}", is_user_error=True))

    def _set_tags(self, request: dict, auth: dict) -> dict:
        module_id, tags = request.get("module_id"), request.get("tags")
        if module_id not in self._modules:
            return error_reply(f"unknown module_id {module_id!r}", is_user_error=True)
        with self._lock:
            users = len(self._tags) - len(self._builtin)
        why = check_tags(tags, str(auth.get("user", "")), bool(auth.get("is_admin")),
                         self._builtin)
        if why is None and users + len(tags) > MAX_USER_TAGS:
            why = f"at most {MAX_USER_TAGS} user tags"
        if why is not None:
            return error_reply(why, is_user_error=True)
        now = int(time.time())
        infos = [{"tag": tag, "module_id": module_id, "updated_at": now,
                  "updated_by": str(auth.get("user", "")), "wasm_size": 0, "compiled_size": 0}
                 for tag in tags]
        with self._lock:
            self._tags.update({info["tag"]: info for info in infos})
        return ok_reply({"tags": infos})

    def _answer(self, reply: Callable[[dict], None], handler: Callable[[dict], dict],
                request: dict) -> None:
        try:
            reply(handler(request))
        except Exception as exc:  # answered, so the frontend never waits out its timeout
            reply(error_reply(f"{type(exc).__name__}: {exc}"))

    def _controller(self, request: dict) -> _Seq | dict:
        req_id = request.get("req_id")
        with self._lock:
            seq = self._live.get(req_id) if isinstance(req_id, str) else None
        return seq or error_reply(f"no controller for req_id {req_id!r}", is_user_error=True)

    def _advance(self, request: dict) -> dict:
        """Between segments: ``post_process(tokens, backtrack)`` when given, then the
        ``pre_process`` owed. Answers the sequence's state: ``stop``, ``error`` and the pending
        ``pre`` result (``suspend`` / ``num_forks`` / ``ff_tokens``; None once stopped), plus
        the ``logs`` and ``storage`` of every call since the previous ``advance``."""
        seq = self._controller(request)
        if isinstance(seq, dict):
            return seq
        tokens, backtrack = request.get("tokens") or [], int(request.get("backtrack") or 0)
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return error_reply("'tokens' is a list of token ids", is_user_error=True)
        with self._lock:
            # The engine is done with the segment, though its ``freed`` may come later:
            # from here its steps leave this controller alone.
            self._unbind(seq, seq.bound_to)
        error = seq.failed
        seq.touched = time.monotonic()  # a branch that only waits is not idle
        if _suspended(seq):  # asked again: what it waits for may have come meanwhile
            seq.need_pre = True
        if not error and not seq.stopped and (tokens or backtrack):
            call = functools.partial(seq.controller.post_process, list(tokens), backtrack)
            error = self._run_post({0: (seq, call)})[0][1]
        if not error and not seq.stopped and seq.need_pre:
            error = self._run_pre({0: (seq, seq.controller.pre_process)})[0][1]
        state = {"stop": seq.stopped, "error": error or seq.failed, "binds": seq.binds,
                 "pre": None if seq.stopped or error else seq.last_pre}
        seq.ctx.drain()  # this call's entries are in the journal too
        logs, storage = seq.ctx.journal()  # since the last advance: the segment's steps too
        micros, seq.micros = seq.micros, 0
        return ok_reply({**state, "logs": logs, "storage": storage, "micros": micros})

    def _release(self, request: dict) -> dict:
        req_id = request.get("req_id")
        with self._lock:
            seq = self._live.pop(req_id, None) if isinstance(req_id, str) else None
            self._unbind(seq, seq.bound_to if seq is not None else None)
            if seq is not None:
                seq.family.discard(seq.req_id)
        return ok_reply({"released": seq is not None})

    def _fork(self, request: dict) -> dict:
        """Beyond the seed, for engines that fork outside the engine (the frontend runs each
        branch as its own sequence): the controller whose pending pre result asked for
        ``num_forks = n`` is copied under the ``n - 1`` req_ids in ``into`` (branches 1..n-1;
        it stays branch 0). The copies share its variables; every branch owes a pre_process,
        which its next ``advance`` runs."""
        seq = self._controller(request)
        if isinstance(seq, dict):
            return seq
        into = request.get("into")
        if not isinstance(into, list) or not into or \
                not all(isinstance(r, str) and r for r in into) or len(set(into)) != len(into):
            return error_reply("'into' is a list of distinct new req_ids", is_user_error=True)
        asked = (seq.last_pre or {}).get("num_forks", 1)
        if seq.failed or seq.stopped or asked != len(into) + 1:
            return error_reply(f"controller {seq.req_id!r} did not ask for {len(into) + 1} "
                               f"forks", is_user_error=True)
        children = [_copy(seq, req_id) for req_id in into]
        with self._lock:  # checked and taken at once: sibling branches may fork meanwhile
            if any(r in self._live for r in into):
                return error_reply("a req_id in 'into' is already instantiated",
                                   is_user_error=True)
            if len(self._live) + len(into) > self.limits.max_pending:
                return error_reply("too many live controllers; retry later")
            if len(seq.family) + len(into) > self.limits.max_forks:
                return error_reply(f"{len(seq.family) + len(into)} forks exceed the limit of "
                                   f"{self.limits.max_forks} per request", is_user_error=True)
            for child in children:
                self._live[child.req_id] = child
                seq.family.add(child.req_id)
        _tell_branches(seq, children)
        for branch in (seq, *children):
            branch.need_pre, branch.last_pre = True, None
        return ok_reply({"forks": into})

    def _start_instantiate(self, request: dict, reply: Callable[[dict], None]) -> None:
        """Answer with the controller built, or with a timeout after ``Limits.init_s``,
        whichever comes first; a controller finished after its timeout is dropped. With
        ``advance: true`` the answer is the first ``advance``'s (its pre result)."""
        first = threading.Lock()

        def expire() -> None:
            if first.acquire(blocking=False):
                reply(error_reply(f"controller initialization took longer than "
                                  f"{self.limits.init_s * 1000:g} ms", is_user_error=True))

        def build() -> None:
            answer = self._instantiate(request, first)
            timer.cancel()
            if answer is not None and answer.get("type") == "ok" and request.get("advance"):
                # Beyond the seed: the first ``advance`` in the same answer (one round trip
                # less before a controlled request's prefill).
                try:
                    answer = self._advance({"req_id": request["req_id"], "tokens": []})
                except Exception as exc:  # answered, so the frontend never waits out a timeout
                    answer = error_reply(f"{type(exc).__name__}: {exc}")
            if answer is not None:
                reply(answer)

        timer = threading.Timer(self.limits.init_s, expire)
        timer.daemon = True
        timer.start()
        self._side_pool.submit(build)

    def _instantiate(self, request: dict, first: threading.Lock) -> dict | None:
        """The answer, or None when the timeout answered first (nothing is kept then)."""
        answer = self._build(request)
        if not isinstance(answer, _Seq):
            return answer if first.acquire(blocking=False) else None
        req_id = request["req_id"]
        now = time.monotonic()
        with self._lock:
            if not first.acquire(blocking=False):
                return None
            # Controllers nobody released (their frontend died): dropped when idle that long.
            for key in [k for k, p in self._live.items() if p.bound_to is None
                        and now - p.touched > self.limits.pending_ttl_s]:
                del self._live[key]
            if len(self._live) >= self.limits.max_pending:
                return error_reply("too many live controllers; retry later")
            if req_id in self._live:
                return error_reply(f"req_id {req_id!r} is already instantiated",
                                   is_user_error=True)
            self._live[req_id] = answer
        logs, storage = answer.ctx.drain()
        return ok_reply({"logs": logs, "storage": storage} if logs or storage else {})

    def _build(self, request: dict) -> dict | _Seq:
        req_id, module = request.get("req_id"), request.get("module_id")
        arg, prompt = request.get("module_arg"), request.get("prompt", [])
        if not isinstance(req_id, str) or not req_id:
            return error_reply("'req_id' is a non-empty string", is_user_error=True)
        with self._lock:
            factory = self._modules.get(module) or self._modules.get(
                (self._tags.get(module) or {}).get("module_id", ""))
        if factory is None:
            return error_reply(f"unknown controller {module!r}; known: "
                               f"{', '.join(sorted(self._tags))}", is_user_error=True)
        if arg is None:
            arg = ""
        elif not isinstance(arg, str):
            arg = json.dumps(arg)
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        if len(arg) > self.limits.max_arg_bytes or len(prompt) > self.limits.max_arg_bytes:
            return error_reply(f"controller argument or prompt over "
                               f"{self.limits.max_arg_bytes} bytes", is_user_error=True)
        ctx = ControllerContext(self.tokenizer, Variables())
        try:
            controller = factory(ctx, arg, list(prompt))
        except ControllerError as exc:
            return error_reply(str(exc), is_user_error=True)
        except Exception as exc:  # the request's controller failed, not the runtime: the
            # client's error (AICI's ``fail`` in the stream, elsewhere a validation error), as
            # docs/controllers.md says, not an engine failure (HTTP 500 on /v1/run)
            return error_reply(f"{type(exc).__name__}: {exc}", is_user_error=True)
        return _Seq(req_id, controller, ctx, [])


def _suspended(seq: _Seq) -> bool:
    return bool((seq.last_pre or {}).get("suspend"))


def _live_forks(seq: _Seq) -> int:
    """The request's live sequences: the engine's (seed forks) or the frontend's."""
    return max(len(seq.forks), len(seq.family))


def _copy(parent: _Seq, req_id: str) -> _Seq:
    """A fork of ``parent``: its controller copied, sharing its variables and fork counts."""
    ctx = parent.ctx.forked()
    return _Seq(req_id, parent.controller.fork(ctx), ctx, parent.forks, parent.family)


def _tell_branches(parent: _Seq, children: list[_Seq]) -> None:
    """``Controller.forked`` once every copy is made (the parent is branch 0 and leaves its
    fork step when told); a controller that fails at it fails its own branch only."""
    for index, seq in enumerate([parent, *children]):
        try:
            seq.controller.forked(index)
        except Exception as exc:
            seq.failed = f"{type(exc).__name__}: {exc}"


_DEFAULTS = frozenset({Controller.pre_process, Controller.mid_process, Controller.post_process})


def _is_default(call: Callable[[], Any]) -> bool:
    method = getattr(call, "func", call)  # functools.partial of a bound method, or the method
    return getattr(method, "__func__", None) in _DEFAULTS


def _timed(call: Callable[[], Any], clock: list | None = None) -> tuple[Any, str, int]:
    if clock is not None:  # this thread's CPU clock and its reading now, for _cpu_used
        try:
            clock_id = time.pthread_getcpuclockid(threading.get_ident())
            clock += [clock_id, time.clock_gettime(clock_id)]
        except (AttributeError, OSError):  # no per-thread CPU clock: the wall cap bounds it
            pass
    t0 = time.perf_counter()
    try:
        value, error = call(), ""
    except ControllerError as exc:
        value, error = None, str(exc)
    except Exception as exc:  # a controller bug fails its sequence, not the runtime
        value, error = None, f"{type(exc).__name__}: {exc}"
    return value, error, int((time.perf_counter() - t0) * 1e6)


def _cpu_used(clock: list) -> float:
    """CPU seconds the call behind ``clock`` used so far (0 while it waits for a thread)."""
    if not clock:
        return 0.0
    try:
        return time.clock_gettime(clock[0]) - clock[1]
    except OSError:  # the thread is gone: the call is over
        return float("inf")


def _record(seq: _Seq | None, result: Any, error: str, micros: int) -> dict:
    """The seed's per-sequence ``SequenceResult``."""
    logs, storage = seq.ctx.drain() if seq is not None else ("", [])
    return {"error": error, "result": result, "storage": storage, "logs": logs,
            "micros": micros}


def _as_words(allowed: np.ndarray) -> np.ndarray:
    """A mask as ``mid_process`` returns it (a bool per id, or llguidance's packed ``int32``
    bitmask: bit ``t % 32`` of word ``t // 32``) as little-endian ``uint32`` words; ids past
    its end are banned (bool masks are padded with zero bits)."""
    allowed = np.asarray(allowed)
    if allowed.dtype == np.bool_:
        packed = np.packbits(allowed, bitorder="little")
        return np.pad(packed, (0, (-len(packed)) % 4)).view("<u4")
    if allowed.dtype in (np.int32, np.uint32):
        return allowed.astype("<u4", copy=False)
    raise TypeError(f"expected bool or int32 bitmask, got {allowed.dtype}")


def _pack_allowed(words: np.ndarray, allowed: np.ndarray) -> None:
    """Write ``allowed`` as a bitmask row (:func:`_as_words`)."""
    packed = _as_words(allowed)
    n = min(len(packed), len(words))
    words[:n] = packed[:n]
    words[n:] = 0


def _apply_allowed(row: np.ndarray, allowed: np.ndarray) -> None:
    """Ban (``-inf``) every id ``allowed`` (:func:`_as_words`) does not allow in a dense row."""
    bits = np.unpackbits(_as_words(allowed).view(np.uint8), bitorder="little").astype(np.bool_)
    n = min(len(bits), len(row))
    row[:n][~bits[:n]] = -np.inf
    row[n:] = -np.inf

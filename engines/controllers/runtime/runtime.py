"""The controller runtime: the seed's commands, answered for the live controllers of one engine.

``ControllerRuntime.handle_main`` answers the main channel (``ping``, ``tokens``,
``post_pre_process``, ``mid_process``, and beyond the seed ``step``) and ``handle_side`` the side
channel (``engines/controllers/runtime/side.py``: ``instantiate``, ``advance``, ``fork``, ``release``,
``set_tags``, ``get_tags``, ``mk_module``), exactly in the seed's JSON shapes
(``docs/protocols/controller-runtime.md``); ``engines/controllers/ipc/shm.py`` carries them. The
runtime knows nothing of Ray or vLLM, so it is tested directly and over shared memory.

Every controller call runs under aicirt's time bounds (``engines/controllers/runtime/calls.py``); each
phase of a step (post, pre, mid) waits at most the wall cap. Masks are written into the bias
rows by ``engines/controllers/api/masks.py``; one controller's state is a
``engines/controllers/runtime/sequence.py`` record.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from engines.controllers.api.base import PreResult, TokenizerInfo
from engines.controllers.api.masks import apply_allowed, pack_allowed
from engines.controllers.ipc.channels import error_reply, ok_reply
from engines.controllers.ipc.messages import (
    BadMessage,
    FirstHalf,
    MainCommand,
    MidAnswer,
    MidOp,
    MidProcess,
    MidRecord,
    Ping,
    Pong,
    PostOp,
    PostRecord,
    PreOp,
    PreRecord,
    Reply,
    RuntimeStats,
    Step,
    StepAnswer,
    Stopped,
    Tokens,
    Vocabulary,
    read,
)
from engines.controllers.ipc.shm import BiasMatrix
from engines.controllers.runtime.calls import CallRunner, Calls, Limits, Outcome
from engines.controllers.runtime.sequence import ControlledSequence, record, tell_branches
from engines.controllers.runtime.side import SideChannel
from engines.controllers.runtime.tags import ControllerFactory, TagRegistry, module_id_of
from engines.kit.telemetry import STEP_BUCKETS_S, Tally

__all__ = ["ControllerFactory", "ControllerRuntime", "Limits", "module_id_of"]


class ControllerRuntime:
    def __init__(self, tokenizer: TokenizerInfo, controllers: dict[str, ControllerFactory],
                 bias: BiasMatrix | None = None, limits: Limits | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits = limits or Limits()
        self.tags = TagRegistry(controllers)
        self.calls = CallRunner(limits)
        self.lock = threading.Lock()  # _live and _seqs: the side channel's threads too
        self._bias = bias
        self._live: dict[str, ControlledSequence] = {}  # every controller, instantiate→release
        self._seqs: dict[int, ControlledSequence] = {}  # the engine's sequence ids bound to them
        self._side = SideChannel(self)
        self._steps = Tally.empty(STEP_BUCKETS_S)  # the main channel's thread counts them
        self._steps_lock = threading.Lock()  # ... and the side channel's reads them

    def stats(self) -> RuntimeStats:
        """What this runtime counted since it started (the side channel's ``get_stats``)."""
        with self._steps_lock:
            step = Tally(list(self._steps.counts), self._steps.total)
        with self.lock:
            live = len(self._live)
        return RuntimeStats(step, self.calls.timeouts_so_far(), live)

    def close(self) -> None:
        self.calls.close()
        self._side.close()

    def handle_side(self, request: dict, reply: Callable[[dict], None]) -> None:
        self._side.handle(request, reply)

    # --- main channel -----------------------------------------------------------------------

    def handle_main(self, cmd: dict) -> Reply:
        try:
            command = read(cmd, MainCommand)
        except BadMessage as exc:
            return error_reply(str(exc), is_user_error=True)
        match command:
            case Ping():
                return ok_reply(Pong())
            case Tokens():
                return ok_reply(Vocabulary(self.tokenizer.vocab_size))
            case MidProcess(ops=ops):
                return ok_reply(self._mid_process(ops or []))
        began = time.perf_counter()
        half = self._post_pre_process(command.post_ops or [], command.pre_ops or [],
                                      command.freed or [])
        answer = self._step(command, half) if isinstance(command, Step) else half
        with self._steps_lock:
            self._steps.count((time.perf_counter() - began,), STEP_BUCKETS_S)
        return ok_reply(answer)

    def _step(self, command: Step, half: FirstHalf) -> StepAnswer:
        """Beyond the seed: ``post_pre_process`` then ``mid_process`` in one round trip (as
        AICI's ABI v2 merged its phases). ``mid_ops`` lists every row the engine may sample;
        those the first half ends get no mask; ``mid.ids`` gives the bias rows' order."""
        ended = half.ends()
        ops = [op for op in command.mid_ops or [] if op.id not in ended]
        mid = self._mid_process(ops, bits=command.mask_format == "bits")
        mid.ids = [op.id for op in ops]
        return StepAnswer(half.post_seqs, half.pre_seqs, mid)

    def _post_pre_process(self, post_ops: list[PostOp], pre_ops: list[PreOp],
                          freed: list[int]) -> FirstHalf:
        half = FirstHalf({}, {})
        post, pre = half.post_seqs, half.pre_seqs
        self._bind(freed, pre_ops, pre)
        calls = {}
        for op in post_ops:
            seq_id = op.id
            seq = self._seqs.get(seq_id)
            if seq is None:
                post[seq_id] = record(PostRecord, None, None, f"unknown sequence {seq_id}", 0)
            elif not (seq.failed or seq.stopped):
                tokens, backtrack = list(op.tokens or []), op.backtrack or 0
                calls[seq_id] = (seq, functools.partial(seq.controller.post_process, tokens,
                                                        backtrack))
        for seq_id, outcome in self.run_post(calls).items():
            error, seq = outcome.error, calls[seq_id][0]  # the side thread may release it
            post[seq_id] = record(PostRecord, seq, None if error else Stopped(seq.stopped),
                                  error, outcome.micros)
        with self.lock:
            # Only sequences the engine runs now; one the frontend is advancing is unbound.
            # A suspended sequence asks again every step (a sibling may have set what it
            # waits for); it was not scheduled, so no post_process made a pre due.
            calls = {seq_id: (seq, seq.controller.pre_process)
                     for seq_id, seq in self._seqs.items()
                     if seq.bound_to == seq_id and (seq.need_pre or seq.suspended)
                     and not (seq.failed or seq.stopped)}
        for seq_id, outcome in self.run_pre(calls).items():
            pre[seq_id] = record(PreRecord, calls[seq_id][0], outcome.value, outcome.error,
                                 outcome.micros)
        return half

    def _bind(self, freed: list[int], pre_ops: list[PreOp], pre: dict[int, PreRecord]) -> None:
        """Frees the engine's ids it says left, then binds those ``pre_ops`` name."""
        with self.lock:
            for seq_id in freed:
                self.unbind(self._seqs.get(seq_id), seq_id)
            # Bound before the posts: a request vLLM preempted and resumed is bound again
            # in the step that reports the tokens it sampled meanwhile.
            for op in pre_ops:
                seq_id, req_id = op.id, op.req_id
                seq = self._live.get(req_id)
                if seq is None:
                    why = f"no instantiated controller for {req_id!r}"
                elif seq_id in self._seqs or seq.bound_to is not None:
                    why = f"sequence {seq_id} or controller {req_id!r} is already bound"
                else:
                    seq.bound_to = seq_id
                    seq.binds += 1
                    seq.forks.append(seq_id)
                    self._seqs[seq_id] = seq
                    continue
                pre[seq_id] = record(PreRecord, None, None, why, 0)

    def unbind(self, seq: ControlledSequence | None, seq_id: int | None) -> None:
        """Under ``lock``: the engine's ``seq_id`` no longer runs ``seq``."""
        if seq is None or seq_id is None:
            return
        if self._seqs.get(seq_id) is seq:
            del self._seqs[seq_id]
        if seq_id in seq.forks:
            seq.forks.remove(seq_id)
        if seq.bound_to == seq_id:
            seq.bound_to = None

    def run_post(self, calls: Calls) -> dict[Any, Outcome]:
        out = self.calls.run(calls, stateful=True)
        for key, outcome in out.items():
            seq = calls[key][0]
            if outcome.value and not outcome.error:
                seq.stop()
            seq.need_pre, seq.last_pre, seq.touched = True, None, time.monotonic()
        return out

    def run_pre(self, calls: Calls) -> dict[Any, Outcome]:
        """``value`` becomes the pre result (a :class:`PreState`) or an error."""
        out = {}
        for key, outcome in self.calls.run(calls, stateful=True).items():
            value, error, micros = outcome.value, outcome.error, outcome.micros
            seq = calls[key][0]
            seq.need_pre, seq.last_pre = False, None
            result = None
            if not error and not isinstance(value, PreResult):
                error = seq.fail(f"pre_process returned {type(value).__name__}, not PreResult")
            elif not error:
                if not isinstance(value.backtrack, int) or value.backtrack < 0:
                    error = seq.fail(f"backtrack must be a count of tokens >= 0, got "
                                     f"{value.backtrack!r}")
                elif value.num_forks > 1 and seq.live_forks - 1 + value.num_forks > \
                        self.limits.max_forks:
                    error = seq.fail(f"{seq.live_forks - 1 + value.num_forks} forks exceed the "
                                     f"limit of {self.limits.max_forks} per request")
                else:
                    seq.last_pre = result = value.state()
                    if value.num_forks == 0:
                        seq.stop()
            out[key] = Outcome(result, error, micros)
        return out

    def _mid_process(self, ops: list[MidOp], bits: bool = False) -> MidAnswer:
        """The seed's dense float rows, or (``bits``, beyond the seed) allowed-token bitmasks."""
        vocab = self.tokenizer.vocab_size
        rows = None
        if self._bias is not None:
            rows = self._bias.words(len(ops), vocab) if bits else self._bias.rows(len(ops), vocab)
            rows[:] = 0xFFFFFFFF if bits else 0.0
        apply = pack_allowed if bits else apply_allowed
        seqs = self._clone_rows(ops)
        calls = {}
        for i, op in enumerate(ops):
            seq_id = op.id
            if seq_id in seqs:  # its parent was unknown
                continue
            seq = self._seqs.get(seq_id)
            if seq is None:
                seqs[seq_id] = record(MidRecord, None, None, f"unknown sequence {seq_id}", 0)
            elif seq.failed:
                seqs[seq_id] = record(MidRecord, seq, None, seq.failed, 0)
            else:
                calls[i] = (seq, seq.controller.mid_process)
        unmasked = []
        for i, outcome in self.calls.run(calls, stateful=False).items():
            value, error, micros = outcome.value, outcome.error, outcome.micros
            seq = calls[i][0]
            if not error and value is None:
                unmasked.append(i)
            if not error and value is not None and rows is not None:
                try:
                    apply(rows[i], value)
                except (TypeError, ValueError) as exc:
                    error = seq.fail(f"mid_process returned an unusable mask: {exc}")
            seqs[ops[i].id] = record(MidRecord, seq, None, error, micros)
        del rows  # no view of the bias buffer outlives the step
        # Beyond the seed: rows left all-zero, which an engine that knows this may skip (the
        # rows are written all the same, for engines that do not).
        return MidAnswer(seqs, len(ops), sorted(unmasked))

    def _clone_rows(self, ops: list[MidOp]) -> dict[int, MidRecord]:
        """The seed's forks: a row with ``clone_id`` new to us is a copy of that parent. Every
        copy is made before any branch learns its index (the parent leaves its fork step when
        told it is branch 0), and before any row's mid_process. Answers the rows whose parent
        is unknown."""
        failed: dict[int, MidRecord] = {}
        clones: dict[int, list[ControlledSequence]] = {}  # parent id → its copies in this call
        for op in ops:
            seq_id, clone_id = op.id, op.clone_id
            if clone_id is None or seq_id in self._seqs:
                continue
            parent = self._seqs.get(clone_id)
            if parent is None:
                failed[seq_id] = record(MidRecord, None, None, f"unknown parent {clone_id}", 0)
                continue
            child = parent.fork(parent.req_id)
            child.bound_to = seq_id
            parent.forks.append(seq_id)
            self._seqs[seq_id] = child
            clones.setdefault(clone_id, []).append(child)
        for parent_id, group in clones.items():
            tell_branches(self._seqs[parent_id], group)
        return failed

"""One live controller of the runtime: from ``instantiate`` to ``release``, bound to the
engine's sequence ids while its segments run (``docs/protocols/controller-runtime.md``)."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from typing import Any, TypeVar

from engines.controllers.api.base import Controller, ControllerContext
from engines.controllers.ipc.messages import MidRecord, PostRecord, PreRecord, PreState

__all__ = ["ControlledSequence", "Status", "record", "tell_branches"]


class Status(enum.Enum):
    LIVE = "live"  # its controller is asked at every step
    STOPPED = "stopped"  # the controller ended it (pre_process forks 0, post_process stop)
    FAILED = "failed"  # a call raised, overran or returned what cannot be used: ``failure``


class ControlledSequence:
    __slots__ = ("binds", "bound_to", "controller", "ctx", "failure", "family", "forks",
                 "last_pre", "micros", "need_pre", "req_id", "running", "status", "timeouts",
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
        self.status = Status.LIVE
        self.failure = ""  # why, once FAILED
        self.need_pre = True  # a post_process (or the start) since the last pre_process
        self.last_pre: PreState | None = None  # that pre_process's result, until the next post
        self.bound_to: int | None = None  # the engine's sequence id while a segment runs
        self.binds = 0  # segments the engine bound: the frontend checks its hook ran
        self.touched = time.monotonic()
        self.micros = 0  # time its calls ran since the last ``advance`` reported it

    def stop(self) -> None:
        """The controller ended the sequence (a failed one stays failed)."""
        if self.status is Status.LIVE:
            self.status = Status.STOPPED

    def fail(self, why: str) -> str:
        """A call failed or overran: the sequence ends with ``why`` as its error (returned)."""
        self.status, self.failure = Status.FAILED, why
        return why

    @property
    def failed(self) -> str:
        """Why it failed ("" unless it did)."""
        return self.failure if self.status is Status.FAILED else ""

    @property
    def stopped(self) -> bool:
        return self.status is Status.STOPPED

    @property
    def suspended(self) -> bool:
        return self.last_pre is not None and self.last_pre.suspend

    @property
    def live_forks(self) -> int:
        """The request's live sequences: the engine's (seed forks) or the frontend's."""
        return max(len(self.forks), len(self.family))

    def fork(self, req_id: str) -> ControlledSequence:
        """A copy under ``req_id``: its controller copied, sharing the variables and the
        request's fork counts; nothing of this one's progress (a fresh sequence record)."""
        ctx = self.ctx.forked()
        return ControlledSequence(req_id, self.controller.fork(ctx), ctx, self.forks,
                                  self.family)


def tell_branches(parent: ControlledSequence, children: list[ControlledSequence]) -> None:
    """``Controller.forked`` once every copy is made (the parent is branch 0 and leaves its
    fork step when told); a controller that fails at it fails its own branch only."""
    for index, seq in enumerate([parent, *children]):
        try:
            seq.controller.forked(index)
        except Exception as exc:
            seq.fail(f"{type(exc).__name__}: {exc}")


Record = TypeVar("Record", PostRecord, PreRecord, MidRecord)


def record(kind: type[Record], seq: ControlledSequence | None, result: Any, error: str,
           micros: int) -> Record:
    """The seed's per-sequence ``SequenceResult`` of one phase, with the logs and storage
    ``seq``'s controller wrote since the last one."""
    logs, storage = seq.ctx.drain() if seq is not None else ("", [])
    return kind(result=result, error=error, storage=storage, logs=logs, micros=micros)

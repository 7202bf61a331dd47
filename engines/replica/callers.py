"""Abort the generations of a caller that died.

A client that disconnects makes the ingress cancel its Serve call, which aborts the engine
request. An ingress replica that dies cancels nothing: Ray does not stop an actor's streaming
method when the caller is gone, so its generations would decode to the end (400 tokens took
over 30 s on a 2-core AVX2 box) while holding batch slots. The ingress therefore names itself
(its Serve actor's name) with each call; while such calls are in flight this replica looks the
names up in Ray's GCS once a second and cancels the streams of a name that is no longer there
(a Serve replica is never restarted under its name: Serve starts a new one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

__all__ = ["Caller", "CallerWatch", "actor_alive", "current_caller"]

log = logging.getLogger(__name__)

Caller = tuple[str, str]  # (actor name, namespace)
SERVE_NAMESPACE = "serve"  # where Serve creates its replicas' actors


def current_caller() -> Caller | None:
    """This process's name as a caller: the Serve replica actor's name, or None outside one."""
    import ray

    if not ray.is_initialized():
        return None
    name = ray.get_runtime_context().get_actor_name()
    return (name, SERVE_NAMESPACE) if name else None


def actor_alive(caller: Caller) -> bool:
    """Whether the named actor still exists (one GCS lookup, about a millisecond)."""
    import ray

    try:
        ray.get_actor(caller[0], namespace=caller[1])
    except ValueError:  # Ray's answer for a name that is not (or no longer) registered
        return False
    return True


class CallerWatch:
    """Tasks grouped by caller; every ``interval_s`` while any are tracked, the callers are
    checked and a dead caller's tasks cancelled."""

    def __init__(self, alive: Callable[[Caller], bool] = actor_alive, interval_s: float = 1.0):
        self._alive = alive
        self.interval_s = interval_s
        self._tasks: dict[Caller, set[asyncio.Task]] = {}
        self._loop: asyncio.Task | None = None
        self.cancelled = 0  # tasks cancelled because their caller died

    def track(self, caller: Caller, task: asyncio.Task) -> None:
        self._tasks.setdefault(caller, set()).add(task)
        task.add_done_callback(lambda done: self._forget(caller, done))
        if self._loop is None or self._loop.done():
            self._loop = asyncio.ensure_future(self._watch())

    def _forget(self, caller: Caller, task: asyncio.Task) -> None:
        tasks = self._tasks.get(caller)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._tasks[caller]

    async def _watch(self) -> None:
        while self._tasks:
            await asyncio.sleep(self.interval_s)
            for caller in list(self._tasks):
                try:
                    alive = await asyncio.to_thread(self._alive, caller)
                except Exception as exc:  # GCS busy or restarting: no news, ask again later
                    log.debug("caller check for %s failed: %r", caller[0], exc)
                    continue
                if alive:
                    continue
                tasks = self._tasks.pop(caller, set())
                log.warning("caller %s is gone: aborting its %d generations", caller[0],
                            len(tasks))
                for task in tasks:
                    task.cancel()
                self.cancelled += len(tasks)

"""The engine client's monitor: notices that a model has no running replica while no stream of
it passes through this ingress (``gateway.ingress.engine_client``).

A replica that dies while idle is noticed here rather than by the next request, which would
otherwise queue in Serve's router until the replacement is up. Serve's controller is asked, not
the replica: a health call to the replica would queue behind its ongoing requests under load and
read as a failure.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from gateway.ingress.serve_status import SERVE_STATUS

__all__ = ["ReplicaMonitor"]

log = logging.getLogger(__name__)

INTERVAL_S = 2.0  # the default ``interval_s``: how often Serve is asked while requests come
# Where this ingress carries none of the model's requests (in the default layout HAProxy sends
# OpenAI requests straight to the model's own application), asking Serve every 2 s was half of
# the idle ingress replica's CPU (docs/results/benchmarks-2026-12-07.md): after this long
# without a request the monitor asks every ``idle_interval_s`` instead, and a request arriving
# then wakes it to ask at once.
IDLE_AFTER_S = 30.0
IDLE_INTERVAL_S = 10.0  # the default ``idle_interval_s``


class ReplicaMonitor:
    """Asks ``running_replicas`` (blocking, on Serve's status thread) on the ticks every model's
    monitor shares, and calls ``on_none`` when it answers 0; never, where ``interval_s`` is
    None."""

    def __init__(self, running_replicas: Callable[[], int], on_none: Callable[[], None], *,
                 interval_s: float | None, idle_interval_s: float):
        self._running_replicas = running_replicas
        self._on_none = on_none
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s
        self.running: int | None = None  # replicas Serve last reported running
        self.heard_at = 0.0  # when an engine replica last delivered events (monotonic)
        self.task: asyncio.Task | None = None
        self._requested_at = -math.inf  # when a request for the model last came (monotonic)
        self._wake: asyncio.Event | None = None  # a request after a pause: ask now

    def ensure_running(self) -> None:
        if self.interval_s is not None and (self.task is None or self.task.done()):
            self.task = asyncio.ensure_future(self._watch(self.interval_s))

    def _idle(self) -> bool:
        return time.monotonic() - self._requested_at >= IDLE_AFTER_S

    def note_request(self) -> None:
        """A request for the model came through this ingress (health checks do not count)."""
        if self._idle() and self._wake is not None:
            self._wake.set()  # the monitor was idle: a replica may have died unseen meanwhile
        self._requested_at = time.monotonic()

    async def _next_tick(self, interval_s: float) -> None:
        """Until the next shared tick (a multiple of the interval on the monotonic clock), or
        until a request after an idle pause wakes the monitor."""
        every = max(interval_s, self.idle_interval_s) if self._idle() else interval_s
        if self._wake is None:  # made on the ingress's loop, at first use
            self._wake = asyncio.Event()
        try:
            await asyncio.wait_for(self._wake.wait(), every - time.monotonic() % every)
        except TimeoutError:
            pass
        self._wake.clear()

    async def _watch(self, interval_s: float) -> None:
        while True:
            await self._next_tick(interval_s)
            # Streams that delivered meanwhile say as much as Serve would, and a replica that
            # dies under them ends them itself; asking anyway cost the ingress about 5 % of its
            # CPU under load (serve.status() builds every application's status).
            if self.running and time.monotonic() - self.heard_at < interval_s:
                continue
            try:
                running = await asyncio.get_running_loop().run_in_executor(
                    SERVE_STATUS.thread, self._running_replicas)
            except Exception as exc:  # the controller is busy or restarting: no news
                log.debug("serve status failed: %r", exc)
                continue
            self.running = running
            if running == 0:
                self._on_none()

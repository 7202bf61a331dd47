"""A replica's admission by priority (docs/tenancy.md, "Priority and fair share").

An engine's own priority queue (vLLM's) orders only what waits inside it, and a flood of
low-priority requests that fills its batch makes a better request wait for a slot anyway. The
gate keeps at most ``max_running`` generations in the engine; the rest wait here, the best
priority first (lower runs first), then the earliest. The last ``headroom`` slots go only to a
request better than every one running: a flood of one priority fills ``max_running -
headroom`` slots, and a better request starts at once.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["PriorityGate"]


class PriorityGate:
    def __init__(self, max_running: int, headroom: int = 0):
        if not 0 <= headroom < max_running:
            raise ValueError("headroom must be at least 0 and below max_running")
        self.max_running, self.headroom = max_running, headroom
        self.running: Counter[int] = Counter()  # priorities of the generations running
        self._waiting: list[tuple[int, int, asyncio.Future]] = []
        self._order = itertools.count()

    def _admissible(self, priority: int) -> bool:
        count = sum(self.running.values())
        if count >= self.max_running:
            return False
        return count < self.max_running - self.headroom or priority < max(self.running)

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, f in self._waiting if not f.done())

    @asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        """Hold a slot while the body runs (waiting for one first, in priority order)."""
        if not any(not f.done() for _, _, f in self._waiting) and self._admissible(priority):
            self.running[priority] += 1
        else:
            granted = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (priority, next(self._order), granted))
            self._grant()  # it may be better than those waiting, and fit the headroom
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():
                    self._release(priority)  # granted just as it was cancelled
                else:
                    granted.cancel()
                raise
        try:
            yield
        finally:
            self._release(priority)

    def _release(self, priority: int) -> None:
        self.running[priority] -= 1
        if not self.running[priority]:
            del self.running[priority]
        self._grant()

    def _grant(self) -> None:
        while self._waiting:
            priority, _, granted = self._waiting[0]
            if granted.done():  # its caller left
                heapq.heappop(self._waiting)
                continue
            if not self._admissible(priority):
                return
            heapq.heappop(self._waiting)
            self.running[priority] += 1
            granted.set_result(None)

"""Several async streams read as one: each runs as a task into one bounded queue.

The one home of "pump a stream into a queue, read it elsewhere, cancel on exit", which the
engines (several choices or forked branches of one request, a generation re-chunked into
batches for Ray) and the protocols (several prompts of one request) all need. A neutral module:
the engines may import it as they import ``contract`` (``pyproject.toml``'s
import-linter contracts).

What every user relies on:

- items come in arrival order, each stream's own order kept;
- a stream's exception is raised to the reader when it arrives (no stream's failure is lost);
- a stream whose task is cancelled from outside (its caller is gone) ends like a finished one,
  without an error;
- leaving the reader (``async with``'s exit) cancels and awaits every stream's task, which
  closes its iterator: the engine request behind it is aborted;
- the queue is bounded: a stream waits while its reader is ``maxsize`` items behind.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

__all__ = ["Pump"]

T = TypeVar("T")


class _Ended:
    """A stream ran out, or its task was cancelled from outside."""


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_ENDED = _Ended()


class Pump(Generic[T]):
    """``async with Pump(maxsize) as pump``: :meth:`start` streams (also while reading), read
    :meth:`items` or :meth:`batches`; the exit cancels whatever still runs."""

    def __init__(self, maxsize: int):
        self._queue: asyncio.Queue = asyncio.Queue(maxsize)
        self._tasks: list[asyncio.Task] = []
        self._running = 0
        self._held: object | None = None  # an end seen while batching, for the next read
        self._unqueued_ends = 0  # streams cancelled while the queue was full

    async def __aenter__(self) -> Pump[T]:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    def start(self, stream: AsyncIterator[T]) -> asyncio.Task:
        """Run ``stream`` into the queue; its task (cancel it to end the stream early)."""
        self._running += 1
        task = asyncio.create_task(self._pump(stream))
        task.add_done_callback(self._end_if_cancelled)
        self._tasks.append(task)
        return task

    async def _pump(self, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    await self._queue.put(item)
        except Exception as exc:
            await self._queue.put(_Failed(exc))
            return
        await self._queue.put(_ENDED)

    def _end_if_cancelled(self, task: asyncio.Task) -> None:
        """A stream cancelled from outside (even before it started) has ended for the reader,
        which may still read. Never wait here: with the reader gone, nobody empties the queue."""
        if not task.cancelled():
            return
        try:
            self._queue.put_nowait(_ENDED)
        except asyncio.QueueFull:  # the reader sees it once it has read what is queued
            self._unqueued_ends += 1

    async def _take(self) -> object:
        if self._held is not None:
            item, self._held = self._held, None
            return item
        if self._unqueued_ends and self._queue.empty():
            self._unqueued_ends -= 1
            return _ENDED
        return await self._queue.get()

    async def _next(self) -> tuple[bool, T | None]:
        """(True, item), or (False, None) once no stream runs; raises a stream's exception."""
        while self._running:
            item = await self._take()
            if item is _ENDED:
                self._running -= 1
            elif isinstance(item, _Failed):
                self._running -= 1
                raise item.error
            else:
                return True, item  # type: ignore[return-value]
        return False, None

    async def items(self) -> AsyncIterator[T]:
        """Every stream's items as they arrive, until all have ended."""
        while True:
            got, item = await self._next()
            if not got:
                return
            yield item  # type: ignore[misc]

    async def batches(self) -> AsyncIterator[list[T]]:
        """Whatever has arrived each time the reader asks (at least one item), until all
        streams have ended."""
        while True:
            got, item = await self._next()
            if not got:
                return
            batch = [item]
            while not self._queue.empty():
                more = self._queue.get_nowait()
                if isinstance(more, (_Ended, _Failed)):  # counted by the next read
                    self._held = more
                    break
                batch.append(more)
            yield batch  # type: ignore[misc]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

"""Protocol-neutral helpers over internal event streams."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import msgspec

from protocols.internal import ErrorEvent, Event, FinalEvent, TokenEvent

__all__ = ["Peeked", "merge", "peek", "reindexed"]


class Peeked:
    """An event stream whose first event has already been read (so errors can become statuses
    before any response bytes are sent). Iterating yields the first event again, then the rest."""

    def __init__(self, first: Event | None, rest: AsyncIterator[Event]):
        self.first = first
        self._rest = rest

    @property
    def error(self) -> ErrorEvent | None:
        return self.first if isinstance(self.first, ErrorEvent) else None

    async def __aiter__(self) -> AsyncIterator[Event]:
        if self.first is None:
            return
        yield self.first
        async for event in self._rest:
            yield event

    async def aclose(self) -> None:
        aclose = getattr(self._rest, "aclose", None)
        if aclose is not None:
            await aclose()


async def peek(events: AsyncIterator[Event]) -> Peeked:
    """Read the first event of ``events``; an empty stream peeks as ``None``."""
    iterator = aiter(events)
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        first = None
    return Peeked(first, iterator)


async def reindexed(events: AsyncIterator[Event], base: int) -> AsyncIterator[Event]:
    """Shift choice indices by ``base`` (one sub-request of a multi-prompt request)."""
    async for event in events:
        if base and isinstance(event, (TokenEvent, FinalEvent)):
            event = msgspec.structs.replace(event, index=event.index + base)
        yield event


_END = object()


async def merge(streams: Sequence[AsyncIterator[Event]]) -> AsyncIterator[Event]:
    """Interleave several event streams in arrival order; order within each is kept.

    The first :class:`ErrorEvent` from any stream is yielded and ends the merged stream (the
    others are cancelled, which aborts their engine requests).
    """
    if len(streams) == 1:
        async for event in streams[0]:
            yield event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[Event]) -> None:
        try:
            async for event in stream:
                await queue.put(event)
        finally:
            await queue.put(_END)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
                continue
            yield item
            if isinstance(item, ErrorEvent):
                break
        for task in tasks:  # surface a pump's exception
            if task.done():
                task.result()
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

"""Helpers for tests of pure stream transforms."""

from collections.abc import AsyncIterator, Iterable


async def _aiter(items: Iterable) -> AsyncIterator:
    """An async iterator over ``items`` (an engine's event stream, say)."""
    for item in items:
        yield item


async def _list(agen: AsyncIterator) -> list:
    return [x async for x in agen]

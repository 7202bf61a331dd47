"""Protocol-neutral helpers over internal event streams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import msgspec

from contract import (
    BacktrackEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    ForkEvent,
    TokenEvent,
)
from contract.pump import Pump
from protocols.tools import Piece, ToolCallReader

__all__ = ["Peeked", "ThinkingPiece", "answer_pieces", "fold_splices", "merge", "peek",
           "reindexed"]


class ThinkingPiece(msgspec.Struct, frozen=True):
    """A reasoning model's thinking (docs/reasoning.md), before the answer's pieces."""

    text: str


def answer_pieces(reader: ToolCallReader, event: TokenEvent | FinalEvent,
                  thinking: bool = True) -> list[Piece | ThinkingPiece]:
    """An event's thinking (where ``thinking`` shows it), then its answer's pieces (text or
    tool calls, read by ``reader``)."""
    pieces: list[Piece | ThinkingPiece] = [ThinkingPiece(event.reasoning)] \
        if event.reasoning and thinking else []
    final = isinstance(event, FinalEvent)
    if event.text or final:
        pieces += reader.read(event.text, final)
    return pieces


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
        if base and isinstance(event, (TokenEvent, FinalEvent, BacktrackEvent)):
            event = msgspec.structs.replace(event, index=event.index + base)
        elif base and isinstance(event, ForkEvent):
            event = ForkEvent(index=event.index + base, parent=event.parent + base)
        yield event


async def fold_splices(events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """For whole (non-streamed) responses: apply backtracks and forks, so collectors that only
    append see each choice's final tokens. Tokens are held per choice until its FinalEvent
    (a fork's copy is re-indexed); prompt events pass straight through, and an error, which
    ends the stream, comes after what was held."""
    held: dict[int, list[TokenEvent]] = {}
    error: ErrorEvent | None = None
    async for event in events:
        if isinstance(event, TokenEvent):
            held.setdefault(event.index, []).append(event)
        elif isinstance(event, FinalEvent):
            for token in held.pop(event.index, ()):
                yield token
            yield event
        elif isinstance(event, BacktrackEvent):
            tokens = held.get(event.index, [])
            del tokens[max(0, len(tokens) - event.count):]
        elif isinstance(event, ForkEvent):
            held[event.index] = [msgspec.structs.replace(t, index=event.index)
                                 for t in held.get(event.parent, ())]
        elif isinstance(event, ErrorEvent):
            error = event
            break
        else:
            yield event
    for tokens in held.values():  # the stream broke off: what was generated still counts
        for token in tokens:
            yield token
    if error is not None:
        yield error


# Events the merged streams may run ahead of the reader; beyond it they wait for it.
_MERGE_AHEAD = 1024


async def merge(streams: Sequence[AsyncIterator[Event]]) -> AsyncIterator[Event]:
    """Interleave several event streams in arrival order; order within each is kept.

    The first :class:`ErrorEvent` from any stream is yielded and ends the merged stream (the
    others are cancelled, which aborts their engine requests).
    """
    if len(streams) == 1:
        async for event in streams[0]:
            yield event
        return
    async with Pump[Event](_MERGE_AHEAD) as pump:
        for stream in streams:
            pump.start(stream)
        async for event in pump.items():
            yield event
            if isinstance(event, ErrorEvent):
                return

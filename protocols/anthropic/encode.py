"""Internal events → Anthropic's Message, whole or as its stream of server-sent events
(``message_start``, per content block ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta``, ``message_stop``; ``error`` mid-stream). docs/protocols/anthropic.md."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic_core import from_json

from contract import (
    BacktrackEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    ForkEvent,
    TokenEvent,
    splice_refusal,
)
from protocols.anthropic.errors import error_body, from_event
from protocols.sse import named_events
from protocols.streams import ThinkingPiece, answer_pieces, fold_splices
from protocols.tools import CallStart, Piece, TextPiece, ToolCallReader, ToolChoice, whole_text

__all__ = ["MessageMeta", "message_events", "message_response", "sse"]


@dataclass(frozen=True)
class MessageMeta:
    id: str
    model: str
    tools: ToolChoice
    input_tokens: int = 0  # the prompt's, for a stream's message_start
    thinking: bool = False  # show a reasoning model's thinking as thinking blocks


def signature(thinking: str) -> str:
    """A thinking block's ``signature``: Anthropic's is opaque and checked by its API only;
    this one is a digest of the text (the gateway does not read thinking sent back)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _reader(tools: ToolChoice) -> ToolCallReader:
    return ToolCallReader.for_choice(tools, id_prefix="toolu_")


def _stop(final: FinalEvent, called: bool) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence``."""
    if final.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if final.finish_reason == "stop_sequence" and isinstance(final.stop_reason, str):
        return "stop_sequence", final.stop_reason
    return "end_turn", None


def _input(arguments: str) -> dict[str, Any]:
    """A ``tool_use`` block's ``input``: a cut call's as far as its JSON got, read as the
    anthropic SDK reads a streamed block's ``input_json_delta`` s (an unfinished value left
    out), so the whole message equals the stream's (docs/protocols/tools.md)."""
    return from_json(arguments, allow_partial=True) if arguments else {}


async def message_response(events: AsyncIterator[Event], meta: MessageMeta) -> dict[str, Any]:
    """The whole Message; an error event raises. A call cut off by ``max_tokens`` is there
    with the input it had got (``stop_reason: max_tokens``), as the stream has it."""
    reader, pieces, final, output = _reader(meta.tools), [], None, 0
    thought: list[str] = []
    async for event in fold_splices(events):
        if isinstance(event, ErrorEvent):
            raise from_event(event)
        if isinstance(event, TokenEvent | FinalEvent):
            output += isinstance(event, TokenEvent)
            final = event if isinstance(event, FinalEvent) else final
            thought.append(event.reasoning)
            pieces += answer_pieces(reader, event, thinking=False)
    assert final is not None  # the stream contract: a FinalEvent ends every choice
    text, calls = whole_text(pieces, reader)
    thinking = "".join(thought)
    content: list[dict[str, Any]] = [
        {"type": "thinking", "thinking": thinking, "signature": signature(thinking)}
    ] if thinking and meta.thinking else []
    content += [{"type": "text", "text": text}] if text else []
    content += [{"type": "tool_use", "id": call.id, "name": call.name,
                 "input": _input(call.arguments) if call.cut else json.loads(call.arguments)}
                for call in calls]
    stop_reason, stop_sequence = _stop(final, bool(calls))
    return {"id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": final.usage.prompt_tokens, "output_tokens": output}}


class _Blocks:
    """The stream's content blocks: one open at a time, a new one when the kind changes."""

    def __init__(self) -> None:
        self.index, self.open_kind, self.called = -1, None, False
        self.thought = ""  # the open thinking block's text, for its signature

    def events(self, piece: Piece | ThinkingPiece) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        if isinstance(piece, ThinkingPiece):
            if self.open_kind != "thinking":
                out += self.close()
                out.append(self._start({"type": "thinking", "thinking": "", "signature": ""},
                                       "thinking"))
            self.thought += piece.text
            delta = {"type": "thinking_delta", "thinking": piece.text}
        elif isinstance(piece, TextPiece):
            if self.open_kind != "text":
                out += self.close()
                out.append(self._start({"type": "text", "text": ""}, "text"))
            delta = {"type": "text_delta", "text": piece.text}
        elif isinstance(piece, CallStart):
            self.called = True
            out += self.close()
            return [*out, self._start({"type": "tool_use", "id": piece.id, "name": piece.name,
                                       "input": {}}, "tool_use")]
        else:
            delta = {"type": "input_json_delta", "partial_json": piece.text}
        return [*out, ("content_block_delta", {"type": "content_block_delta",
                                               "index": self.index, "delta": delta})]

    def _start(self, block: dict, kind: str) -> tuple[str, dict]:
        self.index, self.open_kind = self.index + 1, kind
        return "content_block_start", {"type": "content_block_start", "index": self.index,
                                       "content_block": block}

    def close(self) -> list[tuple[str, dict]]:
        if self.open_kind is None:
            return []
        out = []
        if self.open_kind == "thinking":
            delta = {"type": "signature_delta", "signature": signature(self.thought)}
            out.append(("content_block_delta", {"type": "content_block_delta",
                                                "index": self.index, "delta": delta}))
            self.thought = ""
        self.open_kind = None
        return [*out, ("content_block_stop", {"type": "content_block_stop", "index": self.index})]


async def message_events(events: AsyncIterator[Event],
                         meta: MessageMeta) -> AsyncIterator[tuple[str, dict]]:
    """The Message as Anthropic's stream events."""
    reader, blocks, output, started = _reader(meta.tools), _Blocks(), 0, False
    async for event in events:
        if not started:
            started = True
            yield "message_start", {"type": "message_start", "message": {
                "id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": meta.input_tokens, "output_tokens": 0}}}
        if isinstance(event, (ErrorEvent, BacktrackEvent, ForkEvent)):
            exc = from_event(event if isinstance(event, ErrorEvent) else splice_refusal(event))
            yield "error", error_body(exc.status, exc.message)
            return
        if isinstance(event, TokenEvent | FinalEvent):
            output += isinstance(event, TokenEvent)
            for piece in answer_pieces(reader, event, meta.thinking):
                for item in blocks.events(piece):
                    yield item
        if isinstance(event, FinalEvent):
            for item in blocks.close():
                yield item
            stop_reason, stop_sequence = _stop(event, blocks.called)
            yield "message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"input_tokens": event.usage.prompt_tokens, "output_tokens": output}}
            yield "message_stop", {"type": "message_stop"}


def sse(items: AsyncIterator[tuple[str, dict]]) -> AsyncIterator[bytes]:
    """``event: <type>`` and ``data: <json>`` per event, as Anthropic's API writes them."""
    return named_events(items)

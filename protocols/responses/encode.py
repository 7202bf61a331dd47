"""Internal events → a Responses API ``response`` object, whole or as its stream of typed
events (``response.created``, ``response.in_progress``, per output item ``output_item.added``,
text parts and deltas or function-call argument deltas, ``output_item.done``, then
``response.completed`` or ``response.incomplete``). docs/protocols/responses.md."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from contract import (
    BacktrackEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    ForkEvent,
    TokenEvent,
    splice_refusal,
)
from protocols.openai.errors import from_event
from protocols.sse import named_events
from protocols.streams import ThinkingPiece, answer_pieces, fold_splices
from protocols.tools import ArgumentsPiece, CallStart, Piece, TextPiece, ToolCallReader, ToolChoice

__all__ = ["ResponseMeta", "response_events", "response_object", "sse"]


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    created_at: int
    model: str
    tools: ToolChoice
    echo: dict[str, Any] = field(default_factory=dict)  # request parameters the object repeats


def _shell(meta: ResponseMeta, status: str, output: list, final: FinalEvent | None = None,
           tokens: int = 0) -> dict[str, Any]:
    usage = None
    if final is not None:
        usage = {"input_tokens": final.usage.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": final.usage.cached_tokens},
                 "output_tokens": tokens,
                 "output_tokens_details": {"reasoning_tokens": final.usage.reasoning_tokens},
                 "total_tokens": final.usage.prompt_tokens + tokens}
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": meta.id, "object": "response", "created_at": meta.created_at,
            "status": status, "model": meta.model, "output": output, "error": None,
            "incomplete_details": incomplete, "usage": usage, "store": False,
            "previous_response_id": None, "truncation": "disabled", **meta.echo}


def _status(final: FinalEvent) -> str:
    return "incomplete" if final.finish_reason == "length" else "completed"


def _last_item_status(final: FinalEvent, items: _Items, reader: ToolCallReader) -> str:
    """The open item's status at the end: a message the limit cut, or a call it cut inside
    its arguments, is ``incomplete``; a call it ended after (before the next began) is
    ``completed``, though the response is ``incomplete`` (docs/protocols/tools.md)."""
    if items.open is not None and items.open["type"] == "function_call" and not reader.inside_call:
        return "completed"
    return _status(final)


class _Items:
    """Output items as pieces arrive: a reasoning item for thinking, a message item for text,
    a function_call item per call; one open at a time. Whole responses use the items; streams
    also the events."""

    def __init__(self) -> None:
        self.done: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> tuple[str, dict]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq - 1, **fields}

    def add(self, piece: Piece | ThinkingPiece) -> list[tuple[str, dict]]:
        if isinstance(piece, ThinkingPiece):
            return self._think(piece.text)
        if isinstance(piece, TextPiece):
            out = [] if self.open and self.open["type"] == "message" else self.close()
            index = len(self.done)
            if not self.open:
                self.open = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}",
                             "status": "in_progress", "role": "assistant", "content": []}
                out += [self.event("response.output_item.added", output_index=index,
                                   item=dict(self.open)),
                        self.event("response.content_part.added", item_id=self.open["id"],
                                   output_index=index, content_index=0, part=_part(""))]
            self.open["text"] = self.open.get("text", "") + piece.text
            return [*out, self.event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=index, content_index=0, delta=piece.text,
                                     logprobs=[])]
        if isinstance(piece, CallStart):
            out = self.close()
            self.open = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}",
                         "call_id": piece.id, "name": piece.name, "arguments": "",
                         "status": "in_progress"}
            return [*out, self.event("response.output_item.added", output_index=len(self.done),
                                     item=dict(self.open))]
        assert isinstance(piece, ArgumentsPiece) and self.open is not None
        self.open["arguments"] += piece.text
        return [self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                           output_index=len(self.done), delta=piece.text)]

    def _think(self, text: str) -> list[tuple[str, dict]]:
        out = [] if self.open and self.open["type"] == "reasoning" else self.close()
        index = len(self.done)
        if not self.open:
            self.open = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}",
                         "summary": [], "content": [], "status": "in_progress"}
            out.append(self.event("response.output_item.added", output_index=index,
                                  item=dict(self.open)))
        self.open["text"] = self.open.get("text", "") + text
        return [*out, self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                 output_index=index, content_index=0, delta=text)]

    def close(self, status: str = "completed") -> list[tuple[str, dict]]:
        item, self.open, index = self.open, None, len(self.done)
        if item is None:
            return []
        out = []
        if item["type"] == "reasoning":
            text = item.pop("text", "")
            out.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=text))
            item = {**item, "content": [{"type": "reasoning_text", "text": text}]}
        elif item["type"] == "message":
            text = item.pop("text", "")
            out += [self.event("response.output_text.done", item_id=item["id"],
                               output_index=index, content_index=0, text=text, logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"],
                               output_index=index, content_index=0, part=_part(text))]
            item = {**item, "content": [_part(text)]}
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=item["name"],
                                  arguments=item["arguments"]))
        item["status"] = status
        self.done.append(item)
        return [*out, self.event("response.output_item.done", output_index=index, item=item)]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def response_object(events: AsyncIterator[Event], meta: ResponseMeta) -> dict[str, Any]:
    """The whole response; an error event raises."""
    reader, items, tokens = ToolCallReader.for_choice(meta.tools), _Items(), 0
    async for event in fold_splices(events):
        if isinstance(event, ErrorEvent):
            raise from_event(event)
        if isinstance(event, TokenEvent):
            tokens += 1
            for piece in answer_pieces(reader, event):
                items.add(piece)
        elif isinstance(event, FinalEvent):
            for piece in answer_pieces(reader, event):
                items.add(piece)
            items.close(_last_item_status(event, items, reader))
            return _shell(meta, _status(event), items.done, event, tokens)
    raise AssertionError("the stream contract: a FinalEvent ends every choice")


async def response_events(events: AsyncIterator[Event],
                          meta: ResponseMeta) -> AsyncIterator[tuple[str, dict]]:
    items, reader, tokens = _Items(), ToolCallReader.for_choice(meta.tools), 0
    yield items.event("response.created", response=_shell(meta, "in_progress", []))
    yield items.event("response.in_progress", response=_shell(meta, "in_progress", []))
    async for event in events:
        if isinstance(event, (ErrorEvent, BacktrackEvent, ForkEvent)):
            exc = from_event(event if isinstance(event, ErrorEvent) else splice_refusal(event))
            yield items.event("error", code=str(exc.status), message=exc.message, param=exc.param)
            return
        final = isinstance(event, FinalEvent)
        if isinstance(event, TokenEvent | FinalEvent):
            tokens += 0 if final else 1
            for piece in answer_pieces(reader, event):
                for item in items.add(piece):
                    yield item
        if isinstance(event, FinalEvent):
            status = _status(event)
            for item in items.close(_last_item_status(event, items, reader)):
                yield item
            kind = "response.completed" if status == "completed" else "response.incomplete"
            yield items.event(kind, response=_shell(meta, status, items.done, event, tokens))
            return


def sse(items: AsyncIterator[tuple[str, dict]]) -> AsyncIterator[bytes]:
    """``event: <type>`` and ``data: <json>`` per event, as OpenAI's Responses API writes them."""
    return named_events(items)

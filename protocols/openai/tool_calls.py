"""A chat choice's text as OpenAI's assistant message: ``content``, or ``tool_calls`` read from
the call markup the tools grammar produced (``protocols.tools``), whole or as stream deltas."""

from __future__ import annotations

from typing import Any

from protocols.tools import CallStart, Piece, TextPiece, ToolCallReader, ToolChoice, whole_text

__all__ = ["ChatDeltas", "chat_message", "tool_finish_reason"]


def _reader(choice: ToolChoice | None) -> ToolCallReader | None:
    """None where no tools were offered: the text is the content as it is, even empty."""
    if choice is None or choice.mode == "none":
        return None
    return ToolCallReader.for_choice(choice)


def tool_finish_reason(finish: str | None, called: bool, choice: ToolChoice | None) -> str | None:
    """OpenAI's: ``tool_calls`` when the model chose to call (``auto``, ``required``); a call
    forced by name ends ``stop``, as OpenAI's own API answers; a cut-off call stays ``length``."""
    if not called or finish in (None, "length") or choice is None:
        return finish
    return "stop" if choice.mode == "function" else "tool_calls"


def chat_message(text: str, choice: ToolChoice | None) -> tuple[dict[str, Any], bool]:
    """The assistant message for a whole choice's ``text``, and whether it calls tools."""
    reader = _reader(choice)
    if reader is None:
        return {"role": "assistant", "content": text}, False
    content, calls = whole_text(reader.read(text, final=True), reader)
    message: dict[str, Any] = {"role": "assistant", "content": (content or None) if calls else content}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return message, bool(calls)


class ChatDeltas:
    """Per choice of one stream: its text as ``delta`` objects (content, or ``tool_calls``
    entries: index, id, type and name once, then argument fragments)."""

    def __init__(self, choice: ToolChoice | None) -> None:
        self.choice = choice
        self.readers: dict[int, ToolCallReader | None] = {}
        self.called: set[int] = set()

    def text(self, index: int, text: str, final: bool = False) -> list[dict[str, Any]]:
        if index not in self.readers:
            self.readers[index] = _reader(self.choice)
        reader = self.readers[index]
        if reader is None:
            return [{"content": text}] if text or not final else []
        return [self._delta(index, p) for p in reader.read(text, final)]

    def _delta(self, index: int, piece: Piece) -> dict[str, Any]:
        if isinstance(piece, TextPiece):
            return {"content": piece.text}
        self.called.add(index)
        if isinstance(piece, CallStart):
            return {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                    "function": {"name": piece.name, "arguments": ""}}]}
        return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}

    def finish_reason(self, index: int, finish: str) -> str | None:
        return tool_finish_reason(finish, index in self.called, self.choice)

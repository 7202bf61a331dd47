"""Anthropic Messages request bodies as tolerant msgspec Structs: unknown fields are ignored,
as the SDK adds new ones freely; blocks stay dicts, read by ``translate`` by their ``type``."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["CountTokensRequest", "MessageIn", "MessagesRequest", "ToolIn"]


class MessageIn(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]]


class ToolIn(msgspec.Struct, kw_only=True):
    name: Any = None  # checked in translate, where the message can name the tool
    input_schema: Any = None
    description: Any = None
    type: str | None = None  # "custom", or one of Anthropic's server tools (refused)


class _Conversation(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[MessageIn]
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(_Conversation, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its ``format``: structured outputs


class CountTokensRequest(_Conversation, kw_only=True):
    pass

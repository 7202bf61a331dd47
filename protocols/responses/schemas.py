"""OpenAI Responses API request bodies as tolerant msgspec Structs (unknown fields ignored);
input items stay dicts, read by ``translate`` by their ``type``."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["ResponsesRequest"]


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None

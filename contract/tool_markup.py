"""Tool calls in the internal model (a chat message's calls, a prompt's tools; re-exported by
``contract``), and their markup in a model's output, one block per call
(docs/protocols/tools.md): the grammar of every protocol's tool calls makes the model write
it, and engines write earlier calls of a conversation in it where the model's chat template
knows no tools. Neutral: it imports nothing of this project, so engines and protocols share it."""

from __future__ import annotations

import json

import msgspec

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "TOOL_CALL_TAIL", "ToolCall", "ToolDefinition",
           "tool_call_head"]

TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"
TOOL_CALL_TAIL = "}" + TOOL_CALL_CLOSE  # after the arguments


def tool_call_head(name: str) -> str:
    """A call's markup up to its arguments (JSON text follows, then ``TOOL_CALL_TAIL``)."""
    return f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": '


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A call an assistant made: the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


class ToolDefinition(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A function the model may call; ``parameters`` is the JSON schema of its arguments, as
    JSON text."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'

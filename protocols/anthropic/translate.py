"""Anthropic Messages bodies → the internal request (docs/protocols/anthropic.md).

Content blocks: ``text`` anywhere, ``tool_use`` in assistant turns (→ the message's
``tool_calls``), ``tool_result`` in user turns (→ ``tool`` messages, before the turn's text);
``thinking`` / ``redacted_thinking`` in assistant turns are accepted and left out of the prompt
(reasoning models' templates drop earlier thinking); anything else (images, documents) is
refused with a 400 naming the block.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgspec

from contract import (
    ChatMessage,
    ChatPrompt,
    ControllerSpec,
    GenerateRequest,
    OutputOptions,
    ReasoningOptions,
    Sampling,
    ToolCall,
    ToolDefinition,
)
from protocols.anthropic.errors import AnthropicError
from protocols.anthropic.schemas import MessagesRequest, ToolIn, _Conversation
from protocols.controllers import json_schema_controller
from protocols.jsonbody import BodyError, decode_json
from protocols.tools import ToolChoice, tool_definitions, tools_controller

__all__ = ["chat_prompt", "decode_body", "messages_request"]

T = TypeVar("T")


def decode_body(raw: bytes, schema: type[T]) -> T:
    if not raw.strip():
        raise AnthropicError(400, "request body is empty; expected a JSON object")
    try:
        return decode_json(raw, schema)
    except msgspec.ValidationError as exc:
        raise AnthropicError(400, f"invalid request: {exc}") from None
    except BodyError as exc:
        raise AnthropicError(400, f"malformed JSON body: {exc}") from None


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AnthropicError(400, message)


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    for i, block in enumerate(blocks):
        _check(block.get("type") == "text" and isinstance(block.get("text"), str),
               f"{where}.{i}: only text blocks are supported here, got {block.get('type')!r}")
    return "\n".join(block["text"] for block in blocks)


def _tools(tools: list[ToolIn] | None) -> tuple[ToolDefinition, ...]:
    try:
        return tool_definitions(tools or [], _client_tool, "tools.{}")
    except ValueError as exc:
        raise AnthropicError(400, str(exc) if str(exc).startswith("tools.") else f"tools: {exc}") \
            from None


def _client_tool(tool: ToolIn, where: str) -> tuple[Any, Any, Any]:
    if tool.type not in (None, "custom"):
        raise ValueError(f"{where}: tool type {tool.type!r} is not supported (only client "
                         "tools: name, description, input_schema)")
    if tool.input_schema is None:
        raise ValueError(f"{where}.input_schema: Field required")
    return tool.name, tool.description, tool.input_schema


def _tool_choice(raw: dict[str, Any] | None, has_tools: bool) -> tuple[ToolChoice, bool]:
    """The choice, and whether several calls may come in one turn."""
    if raw is None:
        return ToolChoice(mode="auto" if has_tools else "none"), True
    kind = raw.get("type")
    mode = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}.get(kind)
    _check(mode is not None, "tool_choice.type: one of 'auto', 'any', 'tool' or 'none'")
    _check(has_tools or mode == "none", "tool_choice: requires tools")
    _check(mode != "function" or isinstance(raw.get("name"), str), "tool_choice.name: Field "
           "required for type 'tool'")
    parallel = not raw.get("disable_parallel_tool_use", False)
    return ToolChoice(mode=mode, name=raw.get("name") if mode == "function" else None), parallel


def _turn(i: int, message, calls: dict[str, str],
          names: frozenset[str] | None) -> list[ChatMessage]:
    """One Anthropic turn as internal messages: a user turn's tool results (one ``tool``
    message each) before its text; an assistant turn's text with its calls."""
    where = f"messages.{i}"
    _check(message.role in ("user", "assistant"), f"{where}.role: 'user' or 'assistant', got "
           f"{message.role!r}")
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    texts, tool_calls, results = [], [], []
    for j, block in enumerate(message.content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            tool_calls.append(_history_call(f"{where}.content.{j}", block, names))
            calls[tool_calls[-1].id] = tool_calls[-1].name
        elif kind == "tool_result" and message.role == "user":
            results.append(_result(f"{where}.content.{j}", block, calls))
        elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
            pass
        else:
            raise AnthropicError(400, f"{where}.content.{j}: a {kind!r} block is not supported "
                                      f"in a {message.role} turn by this text-only gateway")
    text = "\n".join(texts)
    if message.role == "assistant":
        return [ChatMessage(role="assistant", content=text, tool_calls=tuple(tool_calls))]
    return [*results, *([ChatMessage(role="user", content=text)] if texts else [])]


def _history_call(where: str, block: dict, names: frozenset[str] | None) -> ToolCall:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    _check(isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, dict),
           f"{where}: a tool_use block has a string id and name and an object input")
    _check(names is None or name in names, f"{where}: calls {name!r}, which is not among the tools")
    return ToolCall(id=call_id, name=name, arguments=json.dumps(arguments))


def _result(where: str, block: dict, calls: dict[str, str]) -> ChatMessage:
    call_id = block.get("tool_use_id")
    _check(call_id in calls, f"{where}: tool_result answers tool_use_id {call_id!r}, which no "
           "earlier tool_use block made")
    content = _text_of(block.get("content") or "", f"{where}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return ChatMessage(role="tool", content=content, tool_call_id=call_id, name=calls[call_id])


def chat_prompt(body: _Conversation) -> tuple[ChatPrompt, ToolChoice, bool]:
    """The conversation as the engine renders it, the tool choice, and whether parallel calls
    are allowed. A last assistant turn is a prefill the model continues, as Anthropic's is."""
    _check(len(body.messages) > 0, "messages: at least one message is required")
    tools = _tools(body.tools)
    choice, parallel = _tool_choice(body.tool_choice, bool(tools))
    names = frozenset(t.name for t in tools) or None
    messages = [ChatMessage(role="system", content=_text_of(body.system, "system"))] \
        if body.system else []
    calls: dict[str, str] = {}
    for i, message in enumerate(body.messages):
        messages += _turn(i, message, calls, names)
    prefill = body.messages[-1].role == "assistant"
    # Thinking not asked for is turned off where the template can (Qwen3's enable_thinking);
    # elsewhere the model still thinks and the answer hides it (docs/reasoning.md).
    thinking = body.thinking.get("type") if isinstance(body.thinking, dict) else None
    prompt = ChatPrompt(messages=tuple(messages), add_generation_prompt=not prefill,
                        continue_final_message=prefill,
                        tools=tools if choice.mode != "none" else (),
                        template_kwargs={"enable_thinking": False}
                        if thinking in (None, "disabled") else {})
    return prompt, choice, parallel


def thinking_of(body: _Conversation) -> tuple[bool, ReasoningOptions | None]:
    """Whether the answer shows a reasoning model's thinking, and its budget
    (docs/reasoning.md): ``{"type": "enabled", "budget_tokens": n}`` (n below ``max_tokens``),
    ``{"type": "adaptive"}`` (no budget), ``{"type": "disabled"}`` or none (hidden)."""
    thinking = body.thinking or {"type": "disabled"}
    kind = thinking.get("type")
    _check(kind in ("enabled", "adaptive", "disabled"),
           "thinking.type: 'enabled', 'adaptive' or 'disabled'")
    if kind != "enabled":
        return kind == "adaptive", None
    budget = thinking.get("budget_tokens")
    _check(isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1,
           "thinking.budget_tokens: an integer >= 1 is required when thinking is enabled")
    max_tokens = getattr(body, "max_tokens", None)
    _check(max_tokens is None or budget < max_tokens,
           "thinking.budget_tokens: must be less than max_tokens")
    return True, ReasoningOptions(max_tokens=budget)


def messages_request(body: MessagesRequest, model: str,
                     request_id: str) -> tuple[GenerateRequest, ToolChoice]:
    prompt, choice, parallel = chat_prompt(body)
    _check(body.max_tokens >= 1, "max_tokens: must be at least 1")
    _, reasoning = thinking_of(body)
    temperature = 1.0 if body.temperature is None else body.temperature
    _check(0 <= temperature <= 1, "temperature: must be in [0, 1]")
    top_p = 1.0 if body.top_p is None else body.top_p
    _check(0 < top_p <= 1, "top_p: must be in (0, 1]")
    _check(body.top_k is None or body.top_k >= 0, "top_k: must be >= 0")
    stops = tuple(s for s in body.stop_sequences or () if s)
    request = GenerateRequest(
        request_id=request_id, model=model, prompt=prompt,
        sampling=Sampling(temperature=temperature, top_p=top_p, top_k=body.top_k or 0,
                          max_tokens=body.max_tokens, stop=stops),
        output=OutputOptions(splices="append" if body.stream else "retract"),
        controller=_controller(body, prompt.tools, choice, parallel), reasoning=reasoning)
    return request, choice


def _controller(body: MessagesRequest, tools: tuple[ToolDefinition, ...], choice: ToolChoice,
                parallel: bool) -> ControllerSpec | None:
    """The grammar of the tools offered, or of ``output_config.format``'s JSON schema
    (structured outputs: the answer is one text block of JSON that matches it)."""
    output_format = (body.output_config or {}).get("format")
    if output_format is None:
        try:
            return tools_controller(tools, choice, parallel)
        except ValueError as exc:
            raise AnthropicError(400, f"tool_choice: {exc}" if choice.mode == "function"
                                 else f"tools: {exc}") from None
    _check(isinstance(output_format, dict) and output_format.get("type") == "json_schema",
           "output_config.format: type must be 'json_schema'")
    _check(choice.mode == "none", "output_config.format: this gateway does not combine a "
           "JSON output format with tools; send one or the other")
    _check(isinstance(output_format.get("schema"), dict),
           "output_config.format: a json_schema format needs a schema object")
    return json_schema_controller(output_format["schema"])  # refuses only what is not a dict

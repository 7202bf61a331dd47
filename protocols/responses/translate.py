"""Responses API bodies → the internal request (docs/protocols/responses.md).

Input items: messages (``user``, ``system``, ``developer`` as system, ``assistant``) with text
content, ``function_call`` (joined to the assistant turn it follows) and
``function_call_output`` (a ``tool`` message answering an earlier call), after the stored
context a ``previous_response_id`` names (``routes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
from protocols.controllers import json_schema_controller
from protocols.openai.errors import OpenAIError
from protocols.responses.schemas import ResponsesRequest
from protocols.tools import ToolChoice, history_call, tool_definitions, tools_controller

__all__ = ["input_items", "responses_request"]

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _check(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise OpenAIError(400, message, param)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    _check(isinstance(content, list), f"{where}.content must be a string or a list of parts",
           "input")
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        _check(kind in ("input_text", "output_text") and isinstance(part.get("text"), str),
               f"{where}: content part of type {kind!r} is not supported by this text-only "
               "gateway", "input")
    return "\n".join(part["text"] for part in content)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return body.input


def _messages(body: ResponsesRequest, names: frozenset[str] | None,
              context: Sequence[dict[str, Any]]) -> list[ChatMessage]:
    """The stored context (checked as what it is: turns already taken, whatever tools this
    request names), then the request's own input."""
    out = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    calls: dict[str, str] = {}
    for i, item in enumerate(context):
        if item.get("type") == "function_call" and item.get("status") == "incomplete":
            continue  # cut off by max_output_tokens: its arguments may be partial JSON
        _add(out, calls, item, f"previous_response_id's item {i}", None)
    for i, item in enumerate(input_items(body)):
        _add(out, calls, item, f"input[{i}]", names)
    _check(bool(out), "input must not be empty", "input")
    return out


def _add(out: list[ChatMessage], calls: dict[str, str], item: dict[str, Any], where: str,
         names: frozenset[str] | None) -> None:
    """One input item onto the conversation (``calls``: call id → tool name, so far)."""
    kind = item.get("type", "message")
    if kind == "message":
        role = _ROLES.get(item.get("role"))
        _check(role is not None, f"{where}.role must be user, system, developer or "
               "assistant", "input")
        out.append(ChatMessage(role=role, content=_text(item.get("content"), where)))
    elif kind == "function_call":
        call = _call(item, where, names)
        calls[call.id] = call.name
        last = out[-1] if out else None
        if last is not None and last.role == "assistant":
            out[-1] = ChatMessage(role="assistant", content=last.content,
                                  tool_calls=(*last.tool_calls, call))
        else:
            out.append(ChatMessage(role="assistant", content="", tool_calls=(call,)))
    elif kind == "reasoning":
        pass  # earlier thinking: reasoning models' templates leave it out of the prompt
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        _check(call_id in calls, f"{where}: function_call_output answers call_id "
               f"{call_id!r}, which no earlier function_call made", "input")
        out.append(ChatMessage(role="tool", content=_text(item.get("output", ""), where),
                               tool_call_id=call_id, name=calls[call_id]))
    else:
        raise OpenAIError(400, f"{where}: input items of type {kind!r} are not supported",
                          "input")


def _call(item: dict, where: str, names: frozenset[str] | None) -> ToolCall:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    _check(all(isinstance(v, str) for v in (call_id, name, arguments)),
           f"{where}: a function_call has string call_id, name and arguments", "input")
    try:
        return history_call(call_id, name, arguments, names, where, f"{where}.arguments")
    except ValueError as exc:
        raise OpenAIError(400, str(exc), "input") from None


def _tools(body: ResponsesRequest) -> tuple[tuple[ToolDefinition, ...], ToolChoice]:
    try:
        out = tool_definitions(body.tools or [], _function, "tools[{}]")
    except ValueError as exc:
        raise OpenAIError(400, str(exc), "tools") from None
    raw = body.tool_choice
    if raw is None:
        return out, ToolChoice(mode="auto" if out else "none")
    if isinstance(raw, dict) and raw.get("type") == "function":
        choice = ToolChoice(mode="function", name=raw.get("name"))
    elif raw in ("none", "auto", "required"):
        choice = ToolChoice(mode=raw)
    else:
        raise OpenAIError(400, "tool_choice is 'none', 'auto', 'required' or {\"type\": "
                               "\"function\", \"name\": ...}", "tool_choice")
    _check(bool(out) or choice.mode == "none", "tool_choice needs tools", "tool_choice")
    return out, choice


def _function(tool: dict[str, Any], where: str) -> tuple[Any, Any, Any]:
    if tool.get("type") != "function":
        raise ValueError(f"{where}: tool type {tool.get('type')!r} is not supported; use "
                         "'function'")
    return tool.get("name"), tool.get("description"), tool.get("parameters")


def _controller(body: ResponsesRequest, tools: tuple[ToolDefinition, ...],
                choice: ToolChoice) -> ControllerSpec | None:
    text_format = (body.text or {}).get("format") or {"type": "text"}
    kind = text_format.get("type")
    _check(kind in ("text", "json_object", "json_schema"), f"text.format type {kind!r} is not "
           "supported; use 'text', 'json_object' or 'json_schema'", "text")
    try:
        if choice.mode != "none":
            _check(kind == "text", "text.format cannot be combined with tools", "text")
            return tools_controller(tools, choice, body.parallel_tool_calls)
        if kind == "json_schema":
            _check(isinstance(text_format.get("schema"), dict),
                   "text.format json_schema needs a schema", "text")
            return json_schema_controller(text_format["schema"])
        return json_schema_controller(None) if kind == "json_object" else None
    except ValueError as exc:
        raise OpenAIError(400, str(exc), "tool_choice" if choice.mode == "function" else "text"
                          if choice.mode == "none" else "tools") from None


def responses_request(body: ResponsesRequest, model: str, request_id: str,
                      context: Sequence[dict[str, Any]] = ()) -> tuple[GenerateRequest, ToolChoice]:
    """``context``: the items of the conversation so far (the stored response's), before the
    request's own input."""
    _check(body.max_output_tokens is None or body.max_output_tokens >= 1,
           "max_output_tokens must be at least 1", "max_output_tokens")
    temperature = 1.0 if body.temperature is None else body.temperature
    _check(0 <= temperature <= 2, "temperature must be in [0, 2]", "temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    _check(0 < top_p <= 1, "top_p must be in (0, 1]", "top_p")
    tools, choice = _tools(body)
    names = frozenset(t.name for t in tools) or None
    prompt = ChatPrompt(messages=tuple(_messages(body, names, context)),
                        tools=tools if choice.mode != "none" else ())
    request = GenerateRequest(
        request_id=request_id, model=model, prompt=prompt,
        sampling=Sampling(temperature=temperature, top_p=top_p,
                          max_tokens=body.max_output_tokens),
        output=OutputOptions(splices="append" if body.stream else "retract"),
        controller=_controller(body, tools, choice), reasoning=_reasoning(body.reasoning))
    return request, choice


def _reasoning(reasoning: dict[str, Any] | None) -> ReasoningOptions | None:
    """``reasoning.max_tokens``: a budget for a reasoning model's thinking (OpenRouter's
    field; OpenAI's ``effort`` and ``summary`` are accepted and do not change it;
    docs/reasoning.md)."""
    budget = (reasoning or {}).get("max_tokens")
    if budget is None:
        return None
    _check(isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0,
           "reasoning.max_tokens must be an integer >= 0", "reasoning.max_tokens")
    return ReasoningOptions(max_tokens=budget)

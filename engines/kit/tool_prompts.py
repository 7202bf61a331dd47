"""A chat prompt as a chat template's inputs: messages as dicts, and the tools offered.

A template that knows tools (it reads the ``tools`` variable, as Hugging Face's tool-calling
templates do) gets them in its own way: ``tools=[...]``, assistants' ``tool_calls`` with their
arguments as objects, ``tool`` messages. Any other template gets what docs/protocols/tools.md
describes instead: the tool definitions in the system message, earlier calls in the assistant's
text as the markup the gateway's grammar makes the model write, and tool results as a user
message, so templates that allow only alternating user and assistant turns still render it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta

from contract import ChatMessage, ChatPrompt, ToolDefinition
from contract.tool_markup import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_TAIL, tool_call_head

__all__ = ["template_inputs", "tool_instructions"]


def tool_instructions(listing: str) -> str:
    """The system message's part that offers the tools (``listing``: one JSON object per line)."""
    return ("You may call the functions below to help with the user's request. Each is "
            "described by a JSON object whose \"parameters\" is the JSON schema of its "
            f"arguments:\n<tools>\n{listing}\n</tools>\nTo call functions, answer with nothing "
            f"but one block per call:\n{TOOL_CALL_OPEN}"
            '{"name": <function name>, "arguments": <arguments as a JSON object>}'
            f"{TOOL_CALL_CLOSE}\nTheir results come back to you inside "
            "<tool_response></tool_response>.")


def template_inputs(template: Any, prompt: ChatPrompt) -> tuple[list[dict], list | None]:
    """The messages and the ``tools`` argument for rendering ``prompt`` with ``template`` (a
    tokenizer's ``chat_template``: a string, or named templates, of which ``tool_use`` is the
    one Hugging Face picks when tools are given)."""
    if isinstance(template, dict):
        template = template.get("tool_use", template.get("default"))
    tool_history = any(m.tool_calls or m.role == "tool" for m in prompt.messages)
    if not prompt.tools and not tool_history:
        return [{"role": m.role, "content": m.content} for m in prompt.messages], None
    if isinstance(template, str) and _reads_tools(template):
        tools = [_tool_object(t) for t in prompt.tools] or None
        return [_native_message(m) for m in prompt.messages], tools
    return _plain_messages(prompt), None


@lru_cache(maxsize=64)
def _reads_tools(template: str) -> bool:
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


def _tool_object(tool: ToolDefinition) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": json.loads(tool.parameters)}}


def _native_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        # Templates write arguments with `tojson`: they expect an object, not its text.
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _plain_messages(prompt: ChatPrompt) -> list[dict[str, str]]:
    messages = list(prompt.messages)
    out: list[dict[str, str]] = []
    if prompt.tools:
        listing = "\n".join(json.dumps(_tool_object(t)["function"]) for t in prompt.tools)
        instructions = tool_instructions(listing)
        if messages and messages[0].role == "system":
            instructions = messages.pop(0).content + "\n\n" + instructions
        out.append({"role": "system", "content": instructions})
    in_results = False  # consecutive tool results share one user turn
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if in_results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            in_results = True
            continue
        in_results = False
        calls = "\n".join(tool_call_head(c.name) + c.arguments + TOOL_CALL_TAIL
                          for c in m.tool_calls)
        text = "\n".join(part for part in (m.content, calls) if part)
        out.append({"role": m.role, "content": text})
    return out

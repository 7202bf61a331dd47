"""Tool calling shared by the protocols that offer it (docs/protocols/tools.md).

Each protocol reads its own wire shape into :class:`~contract.ToolDefinition` s and a
:class:`ToolChoice`; from those this module builds the grammar that makes every call the model
writes valid (``tools_controller``, run by the engine's ``llguidance`` controller), and reads
the calls back out of the generated text (:class:`ToolCallReader`), in one pass for a whole
response or piece by piece for a stream.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jsonschema
import msgspec

from contract import ControllerSpec, ToolCall, ToolDefinition
from contract.client import ModelDirectory
from contract.tool_markup import TOOL_CALL_OPEN, TOOL_CALL_TAIL, tool_call_head
from protocols.controllers import grammar_controller

__all__ = ["MAX_TOOLS", "ArgumentsPiece", "CallStart", "ReadCall", "TextPiece", "ToolCallReader",
           "ToolChoice", "grammar_refusal", "history_call", "new_call_id", "tool_definition",
           "tool_definitions", "tools_controller", "whole_text"]

MAX_TOOLS = 128  # OpenAI's own bound on one request's tools
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Arguments as one line of JSON with ", " and ": " (no newline can end a call early); oneOf is
# read as anyOf, as most tool schemas mean it.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                 "coerce_one_of": True}


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    """``none``: no tools offered; ``auto``: text or calls, the model's choice; ``required``: at
    least one call; ``function``: a call of ``name``."""

    mode: Literal["none", "auto", "required", "function"] = "auto"
    name: str | None = None


def tool_definition(name: Any, description: Any, parameters: Any, where: str) -> ToolDefinition:
    """A tool as the internal model holds it; ``ValueError`` naming ``where`` if it is not one."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: a function name is 1 to 64 letters, digits, '_' or '-'; "
                         f"got {name!r}")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}: description must be a string")
    schema = {"type": "object", "properties": {}} if parameters is None else parameters
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: parameters must be a JSON schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"{where}: parameters is not a valid JSON schema: {exc.message}") from None
    return ToolDefinition(name=name, description=description or "", parameters=json.dumps(schema))


def tool_definitions(raw: Sequence[Any], fields: Callable[[Any, str], tuple[Any, Any, Any]],
                     where: str) -> tuple[ToolDefinition, ...]:
    """A request's tools, in a protocol's shape: at most ``MAX_TOOLS``, each read by ``fields``
    (its name, description and parameters schema, or ``ValueError`` if it is not a function
    tool) and named ``where.format(i)`` in errors, their names distinct. ``ValueError`` naming
    what is wrong."""
    if len(raw) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools are allowed")
    out = tuple(tool_definition(*fields(tool, where.format(i)), where.format(i))
                for i, tool in enumerate(raw))
    if len({t.name for t in out}) != len(out):
        raise ValueError("tools must have distinct names")
    return out


def history_call(call_id: str, name: str, arguments: str, names: frozenset[str] | None,
                 where: str, arguments_at: str) -> ToolCall:
    """A call the model made earlier, as a client sends it back in the conversation: named
    among ``names`` (the request's tools; None: not checked) and with ``arguments`` the JSON
    text of an object. ``ValueError`` naming ``where`` (the call) or ``arguments_at``."""
    if names is not None and name not in names:
        raise ValueError(f"{where} calls {name!r}, which is not among the tools")
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"{arguments_at} is not the JSON text of an object")
    return ToolCall(id=call_id, name=name, arguments=arguments)


def tools_controller(tools: tuple[ToolDefinition, ...], choice: ToolChoice,
                     parallel: bool) -> ControllerSpec | None:
    """The grammar controller for ``choice`` over ``tools`` (None for ``none``): a call is the
    markup of ``contract`` around arguments valid against the function's schema;
    ``auto`` also admits any text that does not start like a call. A named function is exactly
    one call whatever ``parallel`` says: a client that names the function reads one call and
    runs it (OpenAI's forced call, Anthropic's ``tool`` choice). ``tools`` are as
    ``tool_definitions`` made them (bounded, distinct)."""
    if choice.mode == "none" or not tools:
        return None
    names = [t.name for t in tools]
    if choice.mode == "function" and choice.name not in names:
        raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
    offered = [t for t in tools if choice.mode != "function" or t.name == choice.name]
    rules = [f"call: {' | '.join(f'call_{i}' for i in range(len(offered)))}"]
    for i, tool in enumerate(offered):
        schema = {**json.loads(tool.parameters), "x-guidance": _JSON_OPTIONS}
        rules.append(f"call_{i}: {_lark_string(tool_call_head(tool.name))} args_{i} "
                     f"{_lark_string(TOOL_CALL_TAIL)}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    several = parallel and choice.mode != "function"
    calls = 'call ("\\n" call)*' if several else "call"
    start = f"start: TEXT | {calls}" if choice.mode == "auto" else f"start: {calls}"
    text = [f"TEXT: /{_not_starting_with(TOOL_CALL_OPEN)}/"] if choice.mode == "auto" else []
    return grammar_controller({"lark_grammar": "\n".join([start, *rules, *text])})


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Lark string literal


_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _regex_char(char: str) -> str:
    if char == "\n":
        return "\\n"
    return "\\" + char if char in _REGEX_META else char


def _not_starting_with(prefix: str) -> str:
    """A regex (Rust syntax) for every text that does not start with ``prefix``: a proper
    prefix of it, or its first ``i`` characters followed by anything but its next one."""
    heads = ["".join(_regex_char(c) for c in prefix[:i]) for i in range(len(prefix))]
    diverging = [f"{head}[^{_regex_char(prefix[i])}](.|\\n)*" for i, head in enumerate(heads)]
    return "|".join([f"({'|'.join(heads)})", *diverging])


async def grammar_refusal(models: ModelDirectory, name: str) -> str | None:
    """Why model ``name`` cannot serve tools (or another grammar), if it cannot: its engine
    runs no controllers. Protocols refuse it in their shape, naming the field that asked."""
    info = await models.info(name)
    if info.capabilities.controllers == "none":
        return (f"tools and structured output need a grammar controller, which the "
                f"{info.engine} engine serving {name} does not run")
    return None


def new_call_id(prefix: str = "call_") -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class TextPiece(msgspec.Struct, frozen=True):
    text: str


class CallStart(msgspec.Struct, frozen=True):
    index: int
    id: str
    name: str


class ArgumentsPiece(msgspec.Struct, frozen=True):
    index: int
    text: str


Piece = TextPiece | CallStart | ArgumentsPiece


class ReadCall(msgspec.Struct, kw_only=True):
    """A call as a whole choice's text held it; ``arguments`` is JSON text, cut short when the
    token limit cut the call (``cut``)."""

    id: str
    name: str
    arguments: str
    cut: bool = False


def whole_text(pieces: list[Piece], reader: ToolCallReader) -> tuple[str, list[ReadCall]]:
    """A whole choice's pieces, all that ``reader`` read, as its text and its calls in order;
    the last is marked ``cut`` if the token limit cut it (docs/protocols/tools.md)."""
    calls: list[ReadCall] = []
    for piece in pieces:
        if isinstance(piece, CallStart):
            calls.append(ReadCall(id=piece.id, name=piece.name, arguments=""))
        elif isinstance(piece, ArgumentsPiece):
            calls[piece.index].arguments += piece.text
    if calls and reader.inside_call:
        calls[-1].cut = True
    return "".join(p.text for p in pieces if isinstance(p, TextPiece)), calls


class ToolCallReader:
    """Reads the text of one choice as it grows into text and calls. Under ``auto`` the text is
    held back while it could still be the start of a call; a call's arguments are released as
    they come, less the characters that could be its closing markup."""

    def __init__(self, calls_only: bool, id_prefix: str = "call_") -> None:
        self.id_prefix = id_prefix  # each call's id: OpenAI's call_..., Anthropic's toolu_...
        self.mode: Literal["undecided", "text", "calls"] = "calls" if calls_only else "undecided"
        self.buffer = ""
        self.calls = 0
        self.in_arguments = False

    @classmethod
    def for_choice(cls, choice: ToolChoice, id_prefix: str = "call_") -> ToolCallReader:
        """The reader for a request's choice: with no tools offered, all of it is text."""
        reader = cls(choice.mode in ("required", "function"), id_prefix)
        if choice.mode == "none":
            reader.mode = "text"
        return reader

    @property
    def inside_call(self) -> bool:
        """Whether the text read so far ends inside a call's arguments; once the choice has
        ended, whether its last call was cut off by the token limit."""
        return self.in_arguments

    def read(self, text: str, final: bool = False) -> list[Piece]:
        """``feed``, and at the choice's end (``final``) ``finish`` too."""
        return [*self.feed(text), *(self.finish() if final else [])]

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        if self.mode == "undecided":
            if self.buffer.startswith(TOOL_CALL_OPEN):
                self.mode = "calls"
            elif not TOOL_CALL_OPEN.startswith(self.buffer):
                self.mode = "text"
        if self.mode == "text":
            out, self.buffer = self.buffer, ""
            return [TextPiece(out)] if out else []
        return self._read_calls(final=False) if self.mode == "calls" else []

    def finish(self) -> list[Piece]:
        """What is left at the end: held-back text, or the arguments of a cut-off call."""
        if self.mode == "calls":  # what is left is the markup of a call cut off in its head
            pieces, self.buffer = self._read_calls(final=True), ""
            return pieces
        out, self.buffer = self.buffer, ""
        return [TextPiece(out)] if out else []

    def _read_calls(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            if not self.in_arguments:
                self.buffer = self.buffer.removeprefix("\n")  # between two calls
                start = _call_start(self.buffer)
                if start is None:
                    return pieces
                name, length = start
                pieces.append(CallStart(self.calls, new_call_id(self.id_prefix), name))
                self.buffer, self.in_arguments = self.buffer[length:], True
            end = self.buffer.find(TOOL_CALL_TAIL)
            if end < 0:
                keep = 0 if final else len(TOOL_CALL_TAIL)
                released = self.buffer[:max(0, len(self.buffer) - keep)]
                self.buffer = self.buffer[len(released):]
                if released:
                    pieces.append(ArgumentsPiece(self.calls, released))
                return pieces
            if end:
                pieces.append(ArgumentsPiece(self.calls, self.buffer[:end]))
            self.buffer = self.buffer[end + len(TOOL_CALL_TAIL):]
            self.in_arguments, self.calls = False, self.calls + 1


_HEAD = re.compile(re.escape(TOOL_CALL_OPEN) + r'\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')


def _call_start(buffer: str) -> tuple[str, int] | None:
    match = _HEAD.match(buffer)
    return (match.group(1), match.end()) if match else None

"""Controller fields shared by the protocols: a named controller and its argument, or a
constraint (JSON schema, regex) run by the built-in ``llguidance`` controller.

Pure translation: the controller itself is the engine's (``engines/controllers``); an unknown
name or a bad grammar is refused there, in the protocol's error shape.
"""

from __future__ import annotations

import json
from typing import Any

from contract import ControllerSpec

__all__ = ["MAX_CONTROLLER_ARG_BYTES", "controller_spec", "grammar_controller", "json_schema_controller",
           "regex_controller"]

# The runtime refuses bigger arguments too; checked here so the error names the field early.
MAX_CONTROLLER_ARG_BYTES = 1 << 20


def controller_spec(name: Any, arg: Any, field: str = "controller") -> ControllerSpec | None:
    """``controller`` (a tag) and ``controller_arg`` (a string, or an object sent as its JSON,
    as AICI's REST API does). Raises ``ValueError`` naming what is wrong."""
    if name is None:
        if arg is not None:
            raise ValueError(f"{field}_arg needs {field}")
        return None
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{field} must be a non-empty string naming a controller")
    if arg is None:
        text = ""
    elif isinstance(arg, str):
        text = arg
    elif isinstance(arg, dict | list):
        text = json.dumps(arg)
    else:
        raise ValueError(f"{field}_arg must be a string or a JSON object")
    if len(text.encode()) > MAX_CONTROLLER_ARG_BYTES:
        raise ValueError(f"{field}_arg is over {MAX_CONTROLLER_ARG_BYTES} bytes")
    return ControllerSpec(module=name, arg=text)


def json_schema_controller(schema: Any) -> ControllerSpec:
    """Output constrained to JSON that matches ``schema`` (``True``/``{}``: any JSON object)."""
    if schema is True or schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema is an object")
    return grammar_controller({"json_schema": schema})


def regex_controller(pattern: Any) -> ControllerSpec:
    """Output constrained to the whole of ``pattern`` (Lark's regex syntax, as TGI and vLLM)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("a regex is a non-empty string")
    return grammar_controller({"lark_grammar": "start: /" + pattern.replace("/", "\\/") + "/"})


def grammar_controller(grammar: dict) -> ControllerSpec:
    """Output constrained by one llguidance grammar (lark, regex or JSON schema)."""
    spec = json.dumps({"grammar": {"grammars": [grammar]}})
    if len(spec.encode()) > MAX_CONTROLLER_ARG_BYTES:
        raise ValueError(f"the grammar is over {MAX_CONTROLLER_ARG_BYTES} bytes")
    return ControllerSpec(module="llguidance", arg=spec)

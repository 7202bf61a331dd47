"""Builders for declctrl programs in the JSON shape AICI's ``pyaici.ast`` emits (microsoft/aici,
not on PyPI), written from that module's documented output: each step is a one-key object
(``{"Gen": {...}}``), optional fields present as ``None`` (pyaici's REST client strips them
before sending), ``label`` added to a step's object, ``{{name}}`` in fixed text expanded to a
``Concat`` of ``String`` and ``Var`` parts."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["choose", "e_concat", "e_current", "e_extract_all", "e_extract_one", "e_ifeq",
           "e_list", "e_str", "e_var", "fixed", "fork", "gen", "json_to_steps", "label",
           "stmt_set", "stop", "wait_vars"]


def stop() -> dict:
    return {"Stop": {}}


def e_current() -> dict:
    return {"Current": {}}


def e_concat(*parts: dict) -> dict:
    return {"Concat": {"parts": list(parts)}}


def e_list(*parts: dict) -> dict:
    return {"Concat": {"list": True, "parts": list(parts)}}


def e_str(text: str) -> dict:
    return {"String": {"str": text}}


def e_var(name: str) -> dict:
    return {"Var": {"var": name}}


def e_ifeq(a: dict, b: dict, eq: dict, neq: dict) -> dict:
    return {"IfEq": {"a": a, "b": b, "eq": eq, "neq": neq}}


def e_extract_one(rx: str, source: dict, template: str = "$1") -> dict:
    return {"Extract": {"from": source, "rx": rx, "template": template, "list": False}}


def e_extract_all(rx: str, source: dict, template: str = "$1") -> dict:
    return {"Extract": {"from": source, "rx": rx, "template": template, "list": True}}


def stmt_set(var: str, expr: dict) -> dict:
    return {"Set": {"var": var, "expr": expr}}


def gen(*, rx: str | None = None, yacc: str | None = None, inner: dict | None = None,
        stop_at: str | None = None, max_tokens: int | None = None, max_words: int | None = None,
        max_bytes: int | None = None, mask_tags: list[str] | None = None,
        stmts: list[dict] | None = None, append_to_var: str | None = None,
        set_var: str | None = None, set: dict[str, dict] | None = None) -> dict:
    statements = list(stmts or [])
    if set_var is not None:
        statements.append(stmt_set(set_var, e_current()))
    if append_to_var is not None:
        statements.append(stmt_set(append_to_var, e_concat(e_var(append_to_var), e_current())))
    for var, expr in (set or {}).items():
        statements.append(stmt_set(var, expr))
    return {"Gen": {"rx": rx, "yacc": yacc,
                    "inner": [{"after": k, "options": v} for k, v in (inner or {}).items()],
                    "stop_at": stop_at, "max_tokens": max_tokens, "max_words": max_words,
                    "max_bytes": max_bytes, "mask_tags": mask_tags, "stmts": statements}}


def fork(*branches: list[dict]) -> dict:
    return {"Fork": {"branches": list(branches)}}


def wait_vars(*names: str) -> dict:
    return {"Wait": {"vars": list(names)}}


def _pattern(text: str) -> dict:
    """``"a {{x}} b"`` → Concat(String "a ", Var x, String " b")."""
    parts: list[dict] = []
    for i, piece in enumerate(re.split(r"\{\{(.*?)\}\}", text)):
        if i % 2:
            parts.append(e_var(piece))
        elif piece:
            parts.append(e_str(piece))
    return e_concat(*parts)


def fixed(text: str | dict, expand_vars: bool = False, following: str | None = None,
          tag: str | None = None) -> dict:
    if isinstance(text, str):
        text = _pattern(text) if expand_vars else e_str(text)
    return {"Fixed": {"text": text, "tag": tag, "following": following}}


def label(name: str, step: dict) -> dict:
    next(iter(step.values()))["label"] = name
    return step


def choose(options: dict | list[str]) -> dict:
    if isinstance(options, list):
        options = e_list(*(e_str(o) for o in options))
    return {"Choose": {"options": options}}


# The string regex pyaici's json_to_steps uses (a non-empty JSON string body).
STRING_RX = r'(\\(["\\\/bfnrt]|u[a-fA-F0-9]{4})|[^"\\\x00-\x1F\x7F]+)+'


def json_to_steps(template: Any) -> list[dict]:
    """Steps that write JSON shaped like ``template``: "" any string, "a|b" one of, a string
    with regex characters a regex, True a boolean, 1 an integer, 1.5 a number, nested objects
    and one-element lists; consecutive fixed texts merged, as pyaici does."""
    steps: list[dict] = []

    def value(v: Any) -> dict:
        if isinstance(v, bool):
            return choose(["true", "false"])
        if isinstance(v, int):
            return gen(rx=r"\d{1,10}")
        if isinstance(v, float):
            return gen(rx=r"\d{1,10}(\.\d{1,10})?")
        if v is None:
            return fixed("null")
        if v == "":
            return gen(rx=STRING_RX, max_words=20)
        if re.search(r"[\[\.\\{()}*+]", v):
            return gen(rx=f"({v})")
        return choose(v.split("|"))

    def walk(v: Any) -> None:
        if isinstance(v, list):
            steps.append(fixed("["))
            if v:
                walk(v[0])
            steps.append(fixed("]"))
        elif isinstance(v, dict):
            steps.append(fixed("{\n"))
            for i, (k, item) in enumerate(v.items()):
                if i:
                    steps.append(fixed(",\n"))
                steps.append(fixed(f'"{k}":'))
                if isinstance(item, str):
                    steps.extend([fixed('"'), value(item), fixed('"')])
                else:
                    walk(item)
            steps.append(fixed("\n}"))
        else:
            steps.append(value(v))

    walk(template)
    merged: list[dict] = []
    for step in steps:
        if "Fixed" in step and merged and "Fixed" in merged[-1]:
            merged[-1]["Fixed"]["text"]["String"]["str"] += step["Fixed"]["text"]["String"]["str"]
        else:
            merged.append(step)
    return merged

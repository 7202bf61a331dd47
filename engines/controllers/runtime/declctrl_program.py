"""A ``declctrl`` program (``engines/controllers/runtime/declctrl.py`` runs it): its steps parsed and
checked, and its expressions evaluated (``docs/protocols/aici.md``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import re2

from engines.controllers.api.base import ControllerError

__all__ = ["KINDS", "MAX_STEPS", "SEP", "Step", "evaluate", "fail", "parse"]

SEP = "\uff0c".encode()  # AICI's list separator (FULLWIDTH COMMA)
KINDS = ("Fixed", "Gen", "Choose", "Stop", "Fork", "Wait")
MAX_VALUE_BYTES = 1 << 20  # one expression's value (variables included)
MAX_STEPS = 1000
_TEMPLATE = re.compile(r"\$(\$|\{(\w+)\}|(\d+))")


@dataclass
class Step:
    kind: str
    spec: dict
    label: str | None = None
    stmts: list = field(default_factory=list)
    uid: int = 0  # its place in the whole program (branches included): key of its regex
    where: str = ""  # for errors: "step 2", "step 1.branch 0.step 1"
    branches: list[list[Step]] = field(default_factory=list)  # a Fork's


def fail(where: str, why: str) -> ControllerError:
    return ControllerError(f"declctrl: {where}: {why}")


def parse(arg: str) -> list[Step]:
    try:
        program = json.loads(arg)
    except json.JSONDecodeError as exc:
        raise ControllerError(f"declctrl: controller_arg is not JSON: {exc}") from None
    steps = program.get("steps") if isinstance(program, dict) else None
    if not isinstance(steps, list) or not steps:
        raise ControllerError('declctrl: controller_arg is {"steps": [<step>, ...]}')
    return [*_parse_steps(steps, "step ", [0]), Step("Stop", {}, uid=-1)]


def _parse_steps(steps: list, where_prefix: str, count: list[int]) -> list[Step]:
    """``count``: steps parsed so far in the whole program (branches included), bounded."""
    parsed = []
    for i, raw in enumerate(steps):
        where = f"{where_prefix}{i}"
        count[0] += 1
        if count[0] > MAX_STEPS:
            raise ControllerError(f"declctrl: more than {MAX_STEPS} steps")
        if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in KINDS:
            raise fail(where, f"a step is one of {{{', '.join(KINDS)}: {{...}}}}")
        kind, spec = next(iter(raw.items()))
        if not isinstance(spec, dict):
            raise fail(where, f"{kind} takes an object")
        step = Step(kind, spec, spec.get("label"), uid=count[0], where=where)
        if kind == "Fork":
            branches = spec.get("branches")
            if not isinstance(branches, list) or len(branches) < 2 or \
                    not all(isinstance(b, list) and b for b in branches):
                raise fail(where, "Fork.branches is a list of two or more non-empty step "
                                   "lists")
            step.branches = [_parse_steps(b, f"{where}.branch {j}.step ", count)
                             for j, b in enumerate(branches)]
            parsed.append(step)
            continue
        if kind == "Wait":
            names = spec.get("vars")
            if not isinstance(names, list) or not names or \
                    not all(isinstance(n, str) for n in names):
                raise fail(where, "Wait.vars is a non-empty list of variable names")
            parsed.append(step)
            continue
        if kind == "Gen":
            _check_gen(spec, where)
        if kind in ("Fixed", "Choose"):
            key = "text" if kind == "Fixed" else "options"
            if not isinstance(spec.get(key), dict):
                raise fail(where, f"{kind}.{key} is an expression")
        stmts = spec.get("stmts") or []
        if not isinstance(stmts, list) or not all(
                isinstance(s, dict) and isinstance(s.get("Set"), dict)
                and isinstance(s["Set"].get("var"), str) and isinstance(s["Set"].get("expr"), dict)
                for s in stmts):
            raise fail(where, 'stmts are [{"Set": {"var": <name>, "expr": <expression>}}]')
        if spec.get("following") is not None and kind != "Fixed":
            raise fail(where, "only Fixed steps take 'following'")
        step.stmts = stmts
        parsed.append(step)
    return parsed


def _check_gen(spec: dict, where: str) -> None:
    if spec.get("yacc") is not None:
        raise fail(where, "yacc grammars are not supported; use rx")
    inner = spec.get("inner") or []
    if not isinstance(inner, list) or not all(
            isinstance(c, dict) and isinstance(c.get("after"), str) and c["after"]
            and isinstance(c.get("options"), dict) for c in inner):
        raise fail(where, 'Gen.inner is [{"after": <text>, "options": <expression>}]')
    if inner and spec.get("rx") is not None:
        raise fail(where, "Gen.inner cannot be combined with rx (as in AICI)")
    for limit in ("max_tokens", "max_words", "max_bytes"):
        value = spec.get(limit)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise fail(where, f"Gen.{limit} is a positive integer")
    for text in ("rx", "stop_at"):
        if spec.get(text) is not None and not isinstance(spec[text], str):
            raise fail(where, f"Gen.{text} is a string")


def evaluate(expr: Any, current: bytes, var: Callable[[str], bytes | None],
             where: str) -> bytes:
    """An expression's value: ``current`` is the step's own text, ``var`` reads the request's
    variables; ``where`` names the step in errors."""
    value = _value(expr, current, var, where)
    if len(value) > MAX_VALUE_BYTES:  # Concat(Var x, Var x) doubles a variable per step
        raise fail(where, f"a value over {MAX_VALUE_BYTES} bytes")
    return value


def _value(expr: Any, current: bytes, var: Callable[[str], bytes | None], where: str) -> bytes:
    def sub(e: Any) -> bytes:
        return evaluate(e, current, var, where)

    if not isinstance(expr, dict) or len(expr) != 1:
        raise fail(where, f"not an expression: {expr!r}")
    kind, spec = next(iter(expr.items()))
    if kind == "String" and isinstance(spec.get("str"), str):
        return spec["str"].encode()
    if kind == "Var" and isinstance(spec.get("var"), str):
        return var(spec["var"]) or b""
    if kind == "Current":
        return current
    if kind == "Concat" and isinstance(spec.get("parts"), list):
        parts = [sub(p) for p in spec["parts"]]
        if sum(map(len, parts)) > MAX_VALUE_BYTES:
            raise fail(where, f"a value over {MAX_VALUE_BYTES} bytes")
        return (SEP if spec.get("list") else b"").join(parts)
    if kind == "IfEq":
        same = sub(spec.get("a")) == sub(spec.get("b"))
        return sub(spec.get("eq" if same else "neq"))
    if kind == "Extract" and isinstance(spec.get("rx"), str):
        source = sub(spec.get("from"))
        try:  # RE2: linear time, so a user's pattern cannot hold a runtime thread
            rx = re2.compile(spec["rx"].encode())
        except re2.error as exc:
            raise fail(where, f"Extract.rx: {exc}") from None
        template = str(spec.get("template", "$1"))
        found = [_expand(m, template) for m in rx.finditer(source)]
        return SEP.join(found) if spec.get("list") else (found[0] if found else b"")
    raise fail(where, f"not an expression: {json.dumps(expr)[:200]}")


def _expand(match: Any, template: str) -> bytes:
    """AICI's (Rust's) ``$1`` / ``${name}`` / ``$$`` template over an RE2 match."""
    def group(m: re.Match) -> str:
        if m.group(1) == "$":
            return "$"
        key = m.group(2) or m.group(3)
        value = None
        for name in ((int(key),) if key.isdigit() else (key, key.encode())):
            try:
                value = match.group(name)
                break
            except IndexError:  # no such group: empty, as AICI's templates
                continue
        return (value or b"").decode("utf-8", errors="surrogateescape")
    return _TEMPLATE.sub(group, template).encode("utf-8", errors="surrogateescape")


"""Tool calls (protocols/tools.py): the grammar ``tools_controller`` builds, run by the engines'
own llguidance controller with the embedded model's real tokenizer, and the reader that turns
the text back into calls. Two stand-in "models" drive the controller: one that wants to write a
script (the allowed token that continues it furthest, else the first allowed), and one that
samples allowed tokens at random (hypothesis draws the schemas): whatever either writes, each
call must parse and validate against its function's schema."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract import ToolCall, ToolDefinition
from engines.controllers.api.base import ControllerContext, Variables
from engines.controllers.runtime.builtin import GuidanceController
from protocols.tools import (
    ArgumentsPiece,
    CallStart,
    TextPiece,
    ToolCallReader,
    ToolChoice,
    history_call,
    tool_definition,
    tools_controller,
)

WEATHER = tool_definition("get_weather", "Weather now", {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}, "tools[0]")
TIME = tool_definition("get_time", None, None, "tools[1]")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    from engines.controllers.runtime.builtin import HFTokenizerInfo
    from engines.kit.embedded import prepare_embedded_model
    return HFTokenizerInfo.from_pretrained(str(prepare_embedded_model(progress=False)))


def _allowed(ctrl, vocab: int) -> np.ndarray:
    bits = np.unpackbits(ctrl.mid_process().astype("<u4").view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


def _run(tok, spec, choose, limit: int = 300) -> tuple[str, bool]:
    """Drive the controller until it stops; ``choose(allowed, text)`` picks each sampled token.
    Returns the text and whether the grammar ended it."""
    ctrl = GuidanceController(ControllerContext(tok, Variables()), spec.arg, [])
    out: list[int] = []
    while len(out) < limit:
        pre = ctrl.pre_process()
        if pre.num_forks == 0:
            return tok.decode(out).decode(), True
        tokens = list(pre.ff_tokens) or [choose(_allowed(ctrl, tok.vocab_size),
                                                tok.decode(out).decode(errors="ignore"))]
        out += tokens
        if ctrl.post_process(tokens, 0):
            return tok.decode([t for t in out if t != tok.eos_token_id]).decode(), True
    return tok.decode(out).decode(errors="replace"), False


def _script(tok, script: str):
    """Off its script, the stand-in closes what it can (a quote, a brace), else takes the first
    allowed token."""
    closers = [tok.encode(c)[0] for c in ('"', "}")]

    def choose(allowed: np.ndarray, text: str) -> int:
        rest = script[len(text):] if script.startswith(text) else ""
        best, best_len = None, 0
        for t in np.flatnonzero(allowed):
            piece = tok.decode([int(t)]).decode(errors="ignore")
            if piece and rest.startswith(piece) and len(piece) > best_len:
                best, best_len = int(t), len(piece)
        if best is not None:
            return best
        return next((t for t in [tok.eos_token_id, *closers] if allowed[t]),
                    int(np.flatnonzero(allowed)[0]))
    return choose


def _calls(text: str, calls_only: bool) -> tuple[str, list[tuple[str, str]]]:
    reader = ToolCallReader(calls_only)
    pieces = [*reader.feed(text), *reader.finish()]
    calls: list[list[str]] = []
    for p in pieces:
        if isinstance(p, CallStart):
            calls.append([p.name, ""])
        elif isinstance(p, ArgumentsPiece):
            calls[p.index][1] += p.text
    return "".join(p.text for p in pieces if isinstance(p, TextPiece)), [tuple(c) for c in calls]


def test_required_lets_a_valid_call_through_exactly(tok):
    spec = tools_controller((WEATHER, TIME), ToolChoice(mode="required"), parallel=False)
    text, ended = _run(tok, spec, _script(tok, CALL))
    assert ended and text == CALL
    assert _calls(text, True) == ("", [("get_weather", '{"city": "Paris", "unit": "c"}')])


def test_required_holds_a_wayward_model_to_the_schema(tok):
    wayward = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}'
    spec = tools_controller((WEATHER, TIME), ToolChoice(mode="required"), parallel=False)
    text, ended = _run(tok, spec, _script(tok, wayward))
    _, calls = _calls(text, True)
    assert ended and len(calls) == 1 and calls[0][0] == "get_weather"
    jsonschema.validate(json.loads(calls[0][1]), json.loads(WEATHER.parameters))


def test_a_named_choice_calls_only_that_function(tok):
    spec = tools_controller((WEATHER, TIME), ToolChoice(mode="function", name="get_time"),
                            parallel=True)
    text, ended = _run(tok, spec, _script(tok, CALL))
    _, calls = _calls(text, True)
    assert ended and len(calls) == 1 and calls[0][0] == "get_time"
    jsonschema.validate(json.loads(calls[0][1]), json.loads(TIME.parameters))


def test_a_named_choice_is_one_call_even_with_parallel_calls_on(tok):
    """A model that would go on calling (as small ones do until ``max_tokens``) is stopped
    after the one call a named choice forces; ``required`` with parallel calls lets it go on."""
    twice = f"{CALL}\n{CALL}"
    named = ToolChoice(mode="function", name="get_weather")
    text, ended = _run(tok, tools_controller((WEATHER, TIME), named, parallel=True),
                       _script(tok, twice))
    assert ended and text == CALL
    text, ended = _run(tok, tools_controller((WEATHER, TIME), ToolChoice(mode="required"),
                                             parallel=True), _script(tok, twice))
    assert ended and text.startswith(twice)


def test_auto_admits_plain_text_and_calls(tok):
    spec = tools_controller((WEATHER,), ToolChoice(mode="auto"), parallel=True)
    text, ended = _run(tok, spec, _script(tok, "It is sunny in Paris."))
    assert ended and _calls(text, False) == ("It is sunny in Paris.", [])
    text, ended = _run(tok, spec, _script(tok, CALL))
    assert ended and _calls(text, False)[1] == [("get_weather", '{"city": "Paris", "unit": "c"}')]
    # A text that starts like a call must become one: half a marker cannot be left as text.
    text, ended = _run(tok, spec, _script(tok, "<tool_call>\nhello"))
    assert ended and _calls(text, False)[1][0][0] == "get_weather"


def test_none_and_no_tools_build_no_grammar():
    assert tools_controller((WEATHER,), ToolChoice(mode="none"), parallel=True) is None
    assert tools_controller((), ToolChoice(mode="auto"), parallel=True) is None


def test_refusals_name_what_is_wrong():
    with pytest.raises(ValueError, match="not among the tools"):
        tools_controller((WEATHER,), ToolChoice(mode="function", name="nope"), parallel=True)
    with pytest.raises(ValueError, match=r"tools\[2\]: a function name"):
        tool_definition("bad name!", None, None, "tools[2]")
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        tool_definition("f", None, {"type": "object", "properties": {"a": {"type": 7}}}, "tools[0]")
    with pytest.raises(ValueError, match="parameters must be a JSON schema object"):
        tool_definition("f", None, [1], "tools[0]")


@pytest.mark.parametrize("calls_only", [True, False])
def test_the_reader_gives_the_same_calls_however_the_text_is_cut(calls_only):
    text = CALL + "\n" + CALL.replace("Paris", 'Rome \\"}\\n</tool_call>')
    whole = _calls(text, calls_only)
    assert [name for name, _ in whole[1]] == ["get_weather", "get_weather"] and whole[0] == ""
    for cut in range(1, len(text)):
        reader = ToolCallReader(calls_only)
        pieces = [*reader.feed(text[:cut]), *reader.feed(text[cut:]), *reader.finish()]
        args = ["", ""]
        for p in pieces:
            if isinstance(p, ArgumentsPiece):
                args[p.index] += p.text
        assert args == [a for _, a in whole[1]], cut


def test_a_call_cut_off_in_its_head_leaves_no_markup_behind():
    for calls_only in (True, False):
        reader = ToolCallReader(calls_only)
        assert [*reader.feed(CALL[:20]), *reader.finish()] == []
    reader = ToolCallReader(calls_only=False)
    assert [*reader.feed("<tool"), *reader.finish()] == [TextPiece("<tool")]  # text, not a call


def test_the_reader_keeps_a_call_cut_off_by_the_token_limit():
    reader = ToolCallReader(calls_only=True)
    pieces = [*reader.feed(CALL[:60]), *reader.finish()]
    head = len('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert isinstance(pieces[0], CallStart) and "".join(
        p.text for p in pieces if isinstance(p, ArgumentsPiece)) == CALL[head:60]


# --- property: random schemas, random allowed tokens ----------------------------------------

_LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda a, d: {"type": "integer", "minimum": a, "maximum": a + d},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "number"}), st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.lists(st.one_of(st.text("abcxyz", min_size=1, max_size=4), st.integers(-9, 9)),
             min_size=1, max_size=4, unique=True).map(lambda values: {"enum": values}),
)


def _object(children):
    return st.dictionaries(st.text("abcdefgh_", min_size=1, max_size=6), children,
                           min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}))


_SCHEMAS = st.recursive(_LEAVES, lambda children: st.one_of(
    st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                        "maxItems": lo + extra},
              children, st.integers(0, 2), st.integers(0, 2)),
    _object(children),
    st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
), max_leaves=6)


@pytest.fixture(scope="module")
def closers(tok) -> list[int]:
    """One-character tokens that end or separate JSON values: a random writer that leans on
    them finishes its calls within a few hundred steps."""
    return [i for i in range(tok.vocab_size)
            if len(tok.decode([i])) == 1 and tok.decode([i]).decode(errors="ignore")
            in '"}],:01 -.{[aex']


def _random_choice(tok, closers: list[int], rng: random.Random):
    closer_set = set(closers)

    def choose(allowed: np.ndarray, text: str) -> int:
        ids = np.flatnonzero(allowed)
        if allowed[tok.eos_token_id] and rng.random() < 0.5:
            return tok.eos_token_id
        near = [int(i) for i in ids if int(i) in closer_set]
        return rng.choice(near) if near and rng.random() < 0.7 else int(rng.choice(ids))
    return choose


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(properties=_object(_SCHEMAS))
def test_every_call_under_required_validates_for_random_schemas(tok, closers, properties):
    tool = tool_definition("f", None, properties, "tools[0]")
    spec = tools_controller((tool,), ToolChoice(mode="required"), parallel=False)
    rng = random.Random(json.dumps(properties, sort_keys=True))  # the same run on a replay
    text, ended = _run(tok, spec, _random_choice(tok, closers, rng), limit=600)
    assert ended, text  # the grammar, not the step limit, ended it
    content, calls = _calls(text, calls_only=True)
    assert content == "" and len(calls) == 1 and calls[0][0] == "f"
    jsonschema.validate(json.loads(calls[0][1]), properties)


def test_tool_definitions_keep_their_schema_as_json_text():
    assert isinstance(WEATHER, ToolDefinition)
    assert json.loads(WEATHER.parameters)["required"] == ["city", "unit"]
    assert json.loads(TIME.parameters) == {"type": "object", "properties": {}}


def test_a_call_sent_back_in_the_history_is_checked_as_the_model_would_have_made_it():
    names = frozenset({"get_weather"})
    assert history_call("c1", "get_weather", '{"city": "Paris"}', names, "m[1]", "m[1].a") == (
        ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}'))
    assert history_call("c1", "other", "{}", None, "m[1]", "m[1].a").name == "other"  # unchecked
    with pytest.raises(ValueError, match=r"m\[1\] calls 'other', which is not among the tools"):
        history_call("c1", "other", "{}", names, "m[1]", "m[1].a")
    for arguments in ("{", "[1]", '"text"'):
        with pytest.raises(ValueError, match=r"m\[1\]\.a is not the JSON text of an object"):
            history_call("c1", "get_weather", arguments, names, "m[1]", "m[1].a")

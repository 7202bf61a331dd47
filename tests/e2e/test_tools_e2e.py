"""Tool calling end to end: the openai SDK → Ray Serve → the vLLM replica, its llguidance
controller holding the embedded model (whose chat template knows no tools) to the call grammar
(docs/protocols/tools.md). Oracles: ``jsonschema`` for every call's arguments, the SDK's own
stream accumulation against the whole response for the same greedy request."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.e2e.conftest import MODEL

WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
SEARCH_SCHEMA = {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 60},
    "filters": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "field": {"enum": ["year", "author"]}, "value": {"type": "integer", "minimum": 0,
                                                        "maximum": 3000}},
        "required": ["field", "value"], "additionalProperties": False}},
    "exact": {"type": "boolean"}}, "required": ["query", "filters"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
                                      "Current weather in a city", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "search_books", "description":
                                      "Search a library catalogue", "parameters": SEARCH_SCHEMA}},
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "search_books": SEARCH_SCHEMA}
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather like in Paris today?"}]
QUESTIONS = ["What is the weather like in Paris today?", "Find books about whales from 1851.",
             "Is it raining in Tokyo?", "Hello! How are you?"]


def _valid(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def _ask(question: str) -> list[dict]:
    return [ASK[0], {"role": "user", "content": question}]


def test_required_always_calls_and_a_two_turn_round_trip_ends_in_an_answer(openai_client):
    first = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _valid(call)
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id,
                "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = openai_client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40,
        temperature=0)
    answer = second.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.parametrize("question", QUESTIONS)
def test_every_call_validates_under_required_and_auto(openai_client, question):
    """One call (``parallel_tool_calls: false``) or several: each that the model finished
    validates; only the last may be cut off, by ``max_tokens`` (a small model may go on
    calling), and then the choice says ``length``."""
    for choice, parallel in (("required", False), ("required", True), ("auto", True)):
        out = openai_client.chat.completions.create(
            model=MODEL, messages=_ask(question), tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=parallel, max_tokens=150, temperature=0)
        message, finish = out.choices[0].message, out.choices[0].finish_reason
        if choice == "required":
            assert message.tool_calls, out
        if not parallel:
            assert len(message.tool_calls) == 1 and finish == "tool_calls", out
        if message.tool_calls:
            assert finish in ("tool_calls", "length") and message.content is None, out
            finished = message.tool_calls[:-1] if finish == "length" else message.tool_calls
            for call in finished:
                _valid(call)
        else:
            assert message.content is not None and finish in ("stop", "length")


def test_a_named_choice_always_calls_that_function(openai_client):
    for question in QUESTIONS:
        out = openai_client.chat.completions.create(
            model=MODEL, messages=_ask(question), tools=TOOLS, max_tokens=200, temperature=0,
            parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "search_books"}})
        calls = out.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "search_books", out
        assert out.choices[0].finish_reason == "stop"  # as OpenAI ends a forced call
        _valid(calls[0])


@pytest.mark.parametrize("question", QUESTIONS[:3])
def test_a_named_choice_with_parallel_calls_on_is_exactly_one_call(openai_client, question):
    """``parallel_tool_calls`` left at its default (on) and a small ``max_tokens``: one call
    that validates, not calls until the limit cuts the last; streamed, the SDK accumulates the
    same call."""
    kwargs = dict(model=MODEL, messages=_ask(question), tools=TOOLS, max_tokens=60,
                  temperature=0, tool_choice={"type": "function",
                                              "function": {"name": "get_weather"}})
    whole = openai_client.chat.completions.create(**kwargs)
    with openai_client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion()
    for out in (whole, streamed):
        [call] = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and out.choices[0].finish_reason == "stop"
        _valid(call)
    assert streamed.choices[0].message.tool_calls[0].function.arguments == \
        whole.choices[0].message.tool_calls[0].function.arguments


def test_a_streamed_call_accumulates_to_exactly_the_whole_one(openai_client):
    kwargs = dict(model=MODEL, messages=_ask(QUESTIONS[1]), tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=200, temperature=0)
    whole = openai_client.chat.completions.create(**kwargs)
    with openai_client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion()
    calls = [[(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
             for r in (whole, streamed)]
    assert calls[0] == calls[1]
    assert streamed.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    for call in streamed.choices[0].message.tool_calls:
        _valid(call)


def test_a_bad_schema_is_the_sdks_bad_request(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=5, tools=[{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 1}}}}}])
    assert info.value.body["param"] == "tools"

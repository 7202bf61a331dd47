"""OpenAI chat tool calling over the fake engine, read by the openai SDK itself (docs/protocols/
tools.md): the fake model "writes" the call markup the grammar would make a real one write
(the grammar itself is tests/unit/test_tools.py's, and the real engine's in the e2e suite)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from contract import ChatPrompt, ToolCall
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from tests.fake_engine import FakeEngine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
ARGS = '{"city": "Paris"}'
CALLS = (f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
ASK = [{"role": "user", "content": "Weather in Paris?"}]


pytestmark = pytest.mark.usefixtures("long_context")


async def test_required_calls_come_back_as_tool_calls_and_the_grammar_went_to_the_engine(openai_on_fake):
    client, engine = openai_on_fake(CALLS)
    out = await client.chat.completions.create(
        model="fake-model", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
        max_tokens=500)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", ARGS), ("get_time", "{}")]
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == 2
    request = engine.requests[-1]
    assert request.controller.module == "llguidance"
    grammar = json.loads(request.controller.arg)["grammar"]["grammars"][0]["lark_grammar"]
    assert "get_weather" in grammar and "get_time" in grammar and "TEXT" not in grammar
    assert isinstance(request.prompt, ChatPrompt)
    assert [t.name for t in request.prompt.tools] == ["get_weather", "get_time"]


async def test_a_streamed_call_accumulates_with_the_sdk_helper_to_the_whole_one(openai_on_fake):
    client, _ = openai_on_fake(CALLS)
    whole = await client.chat.completions.create(
        model="fake-model", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
        max_tokens=500)
    async with client.chat.completions.stream(
            model="fake-model", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
            max_tokens=500) as stream:
        streamed = await stream.get_final_completion()
    pairs = [[(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
             for r in (whole, streamed)]
    assert pairs[0] == pairs[1]
    assert streamed.choices[0].finish_reason == "tool_calls"


async def test_stream_deltas_name_each_call_once_then_send_argument_fragments(openai_on_fake):
    client, _ = openai_on_fake(CALLS)
    stream = await client.chat.completions.create(
        model="fake-model", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
        max_tokens=500, stream=True)
    deltas = [c.choices[0].delta for c in [c async for c in stream] if c.choices]
    entries = [d.tool_calls[0] for d in deltas if d.tool_calls]
    named = [e for e in entries if e.id]
    assert [(e.index, e.function.name, e.function.arguments) for e in named] == [
        (0, "get_weather", ""), (1, "get_time", "")]
    assert "".join(e.function.arguments for e in entries if e.index == 0) == ARGS
    assert all(not d.content for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_lets_plain_text_through_as_content(stream, openai_on_fake):
    client, engine = openai_on_fake("Sunny, 21 degrees.")
    kwargs = dict(model="fake-model", messages=ASK, tools=[WEATHER], max_tokens=100)
    if stream:
        async with client.chat.completions.stream(**kwargs) as s:
            out = await s.get_final_completion()
    else:
        out = await client.chat.completions.create(**kwargs)
    assert out.choices[0].message.content == "Sunny, 21 degrees."
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason == "stop"
    grammar = json.loads(engine.requests[-1].controller.arg)["grammar"]["grammars"][0]
    assert "TEXT" in grammar["lark_grammar"]


async def test_a_named_choice_ends_stop_as_openai_answers_a_forced_call(openai_on_fake):
    client, engine = openai_on_fake(CALLS[:CALLS.index("\n<")])
    out = await client.chat.completions.create(
        model="fake-model", messages=ASK, tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=500)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.tool_calls[0].function.name == "get_weather"
    grammar = json.loads(engine.requests[-1].controller.arg)["grammar"]["grammars"][0]
    assert "get_time" not in grammar["lark_grammar"]


async def test_a_call_cut_off_by_max_tokens_ends_length_as_far_as_it_got(openai_on_fake):
    client, _ = openai_on_fake(CALLS)
    out = await client.chat.completions.create(
        model="fake-model", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.tool_calls[0].function.arguments == '{"city": "P'


async def test_the_history_reaches_the_engine_as_calls_and_results(openai_on_fake):
    client, engine = openai_on_fake("It is sunny.")
    await client.chat.completions.create(model="fake-model", tools=[WEATHER], max_tokens=20, messages=[
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages = engine.requests[-1].prompt.messages
    assert messages[1].tool_calls == (ToolCall(id="call_1", name="get_weather", arguments=ARGS),)
    assert (messages[2].role, messages[2].tool_call_id, messages[2].name, messages[2].content) == (
        "tool", "call_1", "get_weather", "sunny")


async def test_tool_choice_none_offers_no_tools_and_runs_no_grammar(openai_on_fake):
    client, engine = openai_on_fake("Hello")
    out = await client.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER],
                                               tool_choice="none", max_tokens=10)
    assert out.choices[0].message.content == "Hello"
    assert engine.requests[-1].controller is None and engine.requests[-1].prompt.tools == ()


BAD = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [CLOCK] * 129}, "tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "controller": "llguidance"}, "controller"),
    ({"tools": [WEATHER], "messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "rm_rf", "arguments": "{}"}}]}]},
     "messages"),
    ({"tools": [WEATHER], "messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{"}}]}]},
     "messages"),
    ({"tools": [WEATHER], "messages": [*ASK, {"role": "tool", "tool_call_id": "x",
                                               "content": "1"}]}, "messages"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
async def test_bad_tool_requests_are_400s_naming_the_field(extra, param):
    engine = FakeEngine(reply="x", controllers="splice")
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        body = {"model": "fake-model", "messages": ASK, "max_tokens": 5, **extra}
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError" and error["message"]
    assert not engine.requests  # refused before anything ran


async def test_a_model_whose_engine_runs_no_controllers_refuses_tools_naming_them(openai_on_fake):
    client, engine = openai_on_fake(CALLS, controllers="none")
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER],
                                             max_tokens=50)
    assert info.value.body["param"] == "tools" and "grammar controller" in info.value.message
    assert not engine.requests

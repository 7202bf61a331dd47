"""OpenAI's Responses API over the fake engine, read by the openai SDK itself
(docs/protocols/responses.md): text, the SDK's stream accumulation, function calls both ways,
``text.format``, refusals in OpenAI's envelope."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from contract import ToolCall
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from tests.fake_engine import FakeEngine

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


pytestmark = pytest.mark.usefixtures("long_context")


async def test_text_whole_and_streamed(openai_on_fake):
    client, engine = openai_on_fake()
    whole = await client.responses.create(model="fake-model", input="Hi", instructions="Be brief.",
                                          max_output_tokens=50)
    assert whole.output_text == "Hello world" and whole.status == "completed"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    assert [m.role for m in engine.requests[-1].prompt.messages] == ["system", "user"]
    async with client.responses.stream(model="fake-model", input="Hi", instructions="Be brief.",
                                       max_output_tokens=50) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert streamed.output_text == whole.output_text
    assert streamed.usage.output_tokens == whole.usage.output_tokens


async def test_max_output_tokens_makes_an_incomplete_response(openai_on_fake):
    client, _ = openai_on_fake()
    out = await client.responses.create(model="fake-model", input="Hi", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output_text == "Hel"


@pytest.mark.parametrize("stream", [False, True])
async def test_function_calls_come_back_as_function_call_items(stream, openai_on_fake):
    client, engine = openai_on_fake(CALL + "\n" + CALL.replace("Paris", "Rome"))
    kwargs = dict(model="fake-model", input="Weather?", tools=[WEATHER], tool_choice="required",
                  max_output_tokens=300)
    if stream:
        async with client.responses.stream(**kwargs) as s:
            out = await s.get_final_response()
    else:
        out = await client.responses.create(**kwargs)
    calls = [item for item in out.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert all(c.call_id.startswith("call_") and c.status == "completed" for c in calls)
    assert out.output_text == "" and engine.requests[-1].controller.module == "llguidance"


async def test_a_function_call_round_trip_reaches_the_engine(openai_on_fake):
    client, engine = openai_on_fake("Sunny.")
    out = await client.responses.create(model="fake-model", tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert out.output_text == "Sunny."
    messages = engine.requests[-1].prompt.messages
    assert messages[1].tool_calls == (
        ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),)
    assert (messages[2].role, messages[2].name, messages[2].content) == (
        "tool", "get_weather", "sunny")


async def test_text_format_json_schema_runs_the_grammar(openai_on_fake):
    client, engine = openai_on_fake('{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = await client.responses.create(model="fake-model", input="json please", text={
        "format": {"type": "json_schema", "name": "thing", "schema": schema}})
    assert json.loads(out.output_text) == {"a": 1}
    grammar = json.loads(engine.requests[-1].controller.arg)["grammar"]["grammars"][0]
    assert grammar == {"json_schema": schema}


@pytest.mark.parametrize(("extra", "param"), [({"tools": [WEATHER]}, "tools"), (
    {"text": {"format": {"type": "json_object"}}}, "text")])
async def test_an_engine_without_controllers_refuses_grammars_naming_the_field(extra, param, openai_on_fake):
    client, engine = openai_on_fake(controllers="none")
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="fake-model", input="Hi", **extra)
    assert info.value.body["param"] == param and "grammar controller" in info.value.message
    assert not engine.requests


BAD = [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "x", "output": "1"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
async def test_bad_requests_are_400s_in_openais_envelope(extra, param):
    engine = FakeEngine(reply="x", controllers="splice")
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/responses", json={"model": "fake-model", "input": "Hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    assert not engine.requests

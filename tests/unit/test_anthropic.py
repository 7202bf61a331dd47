"""Anthropic's Messages API over the fake engine, read by the anthropic SDK itself
(docs/protocols/anthropic.md): text, streams, stop reasons, tool use both ways, token counts,
errors in Anthropic's shape, auth by ``x-api-key``."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import httpx2
import pytest

from contract import ChatPrompt, ErrorEvent, ToolCall
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.keys import ApiKey
from gateway.ingress.registry import ModelRegistry
from tests.fake_engine import FakeEngine

WEATHER = {"name": "get_weather", "description": "Weather now", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


pytestmark = pytest.mark.usefixtures("long_context")


def _app(reply: str, controllers: str = "splice", **config):
    engine = FakeEngine(reply=reply, controllers=controllers)
    return create_app(ModelRegistry({"fake-model": engine}), GatewayConfig(**config)), engine


def _sdk_http(app) -> httpx2.AsyncClient:
    """The SDK's own HTTP client library (it refuses httpx's), in process."""
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw")


def _sdk(reply: str = "Hello world", controllers: str = "splice"):
    app, engine = _app(reply, controllers)
    http = _sdk_http(app)
    return anthropic.AsyncAnthropic(base_url="http://gw", api_key="x", http_client=http,
                                    max_retries=0), engine


async def test_a_message_whole_and_streamed_are_the_same():
    client, engine = _sdk()
    whole = await client.messages.create(model="fake-model", max_tokens=50, messages=ASK,
                                         system="Be brief.")
    assert [(b.type, b.text) for b in whole.content] == [("text", "Hello world")]
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 12  # 11 characters and the EOS token
    assert whole.usage.input_tokens == len(engine.model.render(engine.requests[-1].prompt))
    assert engine.requests[-1].prompt.messages[0].content == "Be brief."
    async with client.messages.stream(model="fake-model", max_tokens=50, messages=ASK,
                                      system="Be brief.") as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert streamed.content[0].text == "Hello world" and streamed.stop_reason == "end_turn"
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    assert streamed.usage.output_tokens == whole.usage.output_tokens


async def test_message_start_already_counts_the_input_tokens():
    app, engine = _app("Hi")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/messages", json={"model": "fake-model", "max_tokens": 5,
                                                "messages": ASK, "stream": True})
    first = r.text.split("\n\n")[0]
    assert first.startswith("event: message_start\ndata: ")
    usage = anthropic.types.RawMessageStartEvent.model_validate_json(
        first.split("data: ", 1)[1]).message.usage
    assert usage.input_tokens == len(engine.model.render(engine.requests[-1].prompt)) > 0


@pytest.mark.parametrize(("kwargs", "stop_reason", "sequence"), [
    ({"stop_sequences": ["wor"]}, "stop_sequence", "wor"),
    ({"max_tokens": 3}, "max_tokens", None),
])
async def test_stop_reasons(kwargs, stop_reason, sequence):
    client, _ = _sdk()
    out = await client.messages.create(model="fake-model", messages=ASK,
                                       **{"max_tokens": 50, **kwargs})
    assert (out.stop_reason, out.stop_sequence) == (stop_reason, sequence)


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_use_comes_back_as_tool_use_blocks(stream):
    client, engine = _sdk(CALL)
    kwargs = dict(model="fake-model", max_tokens=200, messages=ASK, tools=[WEATHER],
                  tool_choice={"type": "any"})
    if stream:
        async with client.messages.stream(**kwargs) as s:
            out = await s.get_final_message()
    else:
        out = await client.messages.create(**kwargs)
    assert out.stop_reason == "tool_use"
    [block] = out.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input == {"city": "Paris"} and block.id.startswith("toolu_")
    request = engine.requests[-1]
    assert request.controller.module == "llguidance" and request.prompt.tools[0].name == "get_weather"


async def test_a_tool_round_trip_reaches_the_engine_as_calls_and_results():
    client, engine = _sdk("It is sunny.")
    out = await client.messages.create(model="fake-model", max_tokens=50, tools=[WEATHER], messages=[
        *ASK,
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "text", "text": "And so?"}]}])
    assert out.content[0].text == "It is sunny." and out.stop_reason == "end_turn"
    messages = engine.requests[-1].prompt.messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[1].content == "Let me look."
    assert messages[1].tool_calls == (
        ToolCall(id="toolu_1", name="get_weather", arguments='{"city": "Paris"}'),)
    assert (messages[2].tool_call_id, messages[2].name, messages[2].content) == (
        "toolu_1", "get_weather", "sunny")


async def test_a_last_assistant_turn_is_a_prefill():
    client, engine = _sdk()
    await client.messages.create(model="fake-model", max_tokens=5, messages=[
        *ASK, {"role": "assistant", "content": "The weather"}])
    prompt = engine.requests[-1].prompt
    assert isinstance(prompt, ChatPrompt)
    assert prompt.continue_final_message and not prompt.add_generation_prompt


async def test_count_tokens():
    client, engine = _sdk()
    counted = await client.messages.count_tokens(model="fake-model", messages=ASK, system="S")
    assert counted.input_tokens == len("<system>S<user>Weather in Paris?<assistant>")
    assert not engine.requests


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
async def test_structured_output_constrains_the_answer_to_the_json_schema(stream):
    """``output_config.format`` (Anthropic's structured outputs): the engine runs the schema's
    grammar, and the answer is one text block of that JSON."""
    client, engine = _sdk('{"city": "Paris"}')
    kwargs = dict(model="fake-model", max_tokens=50, messages=ASK,
                  output_config={"format": {"type": "json_schema", "schema": CITY},
                                 "effort": "low"})
    if stream:
        async with client.messages.stream(**kwargs) as s:
            out = await s.get_final_message()
    else:
        out = await client.messages.create(**kwargs)
    [block] = out.content
    assert block.type == "text" and block.text == '{"city": "Paris"}'
    controller = engine.requests[-1].controller
    assert controller.module == "llguidance" and '"city"' in controller.arg


BAD = [
    ({"max_tokens": None}, 400, "max_tokens"),
    ({"model": "nope"}, 404, "model"),
    ({"tools": [{"name": "f", "input_schema": {"type": 5}}]}, 400, "tools.0"),
    ({"tools": [{"name": "web", "type": "web_search_20250305"}]}, 400, "tools.0"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]}, 400,
     "messages.0.content.0"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "messages.0.role"),
    ({"messages": []}, 400, "messages"),
    ({"temperature": 1.5}, 400, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
    ({"output_config": {"format": {"type": "json_object"}}}, 400, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema"}}}, 400, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": CITY}}, "tools": [WEATHER]},
     400, "output_config.format"),
]


@pytest.mark.parametrize(("extra", "status", "names"), BAD)
async def test_bad_requests_are_errors_in_anthropics_shape(extra, status, names):
    app, engine = _app("x")
    body = {k: v for k, v in {"model": "fake-model", "max_tokens": 5, "messages": ASK,
                              **extra}.items() if v is not None}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and names in error["error"]["message"]
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert not engine.requests


async def test_the_sdk_raises_its_own_errors_and_route_errors_are_anthropics():
    client, _ = _sdk(controllers="none")
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model="fake-model", max_tokens=5, messages=ASK, tools=[WEATHER])
    assert "grammar controller" in info.value.message
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="gpt-9", max_tokens=5, messages=ASK)
    app, _ = _app("x")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.get("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"


async def test_x_api_key_authenticates_and_a_wrong_key_is_anthropics_401():
    app, _ = _app("Hi", api_key="sekret")
    http = _sdk_http(app)
    ok = anthropic.AsyncAnthropic(base_url="http://gw", api_key="sekret", http_client=http)
    assert (await ok.messages.create(model="fake-model", max_tokens=5, messages=ASK)).content
    bad = anthropic.AsyncAnthropic(base_url="http://gw", api_key="wrong", http_client=http,
                                   max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        await bad.messages.create(model="fake-model", max_tokens=5, messages=ASK)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "authentication_error"


class _Busy(FakeEngine):
    """An engine whose queue is full: every request is refused as ``overloaded``."""

    async def generate(self, request):
        self.requests.append(request)
        yield ErrorEvent(kind="overloaded", message="the engine's queue is full; retry later")


async def test_a_busy_service_is_anthropics_529_and_a_keys_own_limit_its_429():
    """Anthropic's 429 is the caller's rate limit, its 529 (the SDK's OverloadedError) a
    service too busy for anyone; both with Retry-After."""
    app = create_app(ModelRegistry({"fake-model": _Busy()}), GatewayConfig())
    client = anthropic.AsyncAnthropic(base_url="http://gw", api_key="x", max_retries=0,
                                      http_client=_sdk_http(app))
    with pytest.raises(anthropic.OverloadedError) as whole:
        await client.messages.create(model="fake-model", max_tokens=5, messages=ASK)
    with pytest.raises(anthropic.OverloadedError) as streamed:
        async with client.messages.stream(model="fake-model", max_tokens=5, messages=ASK) as s:
            await s.get_final_message()
    for info in (whole, streamed):
        assert info.value.status_code == 529 and info.value.response.headers["retry-after"]
        assert info.value.body["error"]["type"] == "overloaded_error"
    app, _ = _app("Hello world", api_keys=[ApiKey(key="thrifty", tokens_per_min=5)])
    client = anthropic.AsyncAnthropic(base_url="http://gw", api_key="thrifty", max_retries=0,
                                      http_client=_sdk_http(app))
    await client.messages.create(model="fake-model", max_tokens=5, messages=ASK)  # spends 5+
    with pytest.raises(anthropic.RateLimitError) as limited:
        await client.messages.create(model="fake-model", max_tokens=5, messages=ASK)
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    assert limited.value.response.headers["retry-after"]


async def test_the_gateway_at_capacity_is_anthropics_529():
    app = create_app(ModelRegistry({"fake-model": FakeEngine(delay=0.05)}),
                     GatewayConfig(max_concurrent_requests=1))
    body = {"model": "fake-model", "max_tokens": 4, "messages": ASK}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        answers = await asyncio.gather(*(c.post("/v1/messages", json=body) for _ in range(2)))
    [refused] = [a for a in answers if a.status_code != 200]
    assert refused.status_code == 529 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "overloaded_error"

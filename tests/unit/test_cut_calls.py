"""A call cut by the token limit, and a named choice, answered alike by OpenAI chat, the
Responses API and Anthropic's Messages API, whole and streamed, each read by its own SDK over
the fake engine (docs/protocols/tools.md, "When the token limit cuts a call"). The fake engine
writes one character a step, so the limit cuts its scripted reply exactly where a test says."""

from __future__ import annotations

import anthropic
import httpx2
import openai
import pytest

from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from tests.fake_engine import FakeEngine

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
          "required": ["city", "unit"]}
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": SCHEMA}
PARIS = '{"city": "Paris", "unit": "c"}'
ROME = '{"city": "Rome", "unit": "c"}'
FIRST = f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>'
SECOND = f'<tool_call>\n{{"name": "get_weather", "arguments": {ROME}}}\n</tool_call>'
REPLY = f"{FIRST}\n{SECOND}"
INSIDE = len(FIRST) + 1 + SECOND.index(', "unit": "') + len(', "unit": "')  # in "c" of Rome's
BETWEEN = len(FIRST) + 4  # in the second call's opening markup
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]

pytestmark = pytest.mark.usefixtures("long_context")


def _anthropic(reply: str) -> tuple[anthropic.AsyncAnthropic, FakeEngine]:
    engine = FakeEngine(reply=reply, controllers="splice")  # runs the tools grammar
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig())
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw")
    return anthropic.AsyncAnthropic(base_url="http://gw", api_key="x", http_client=http,
                                    max_retries=0), engine


async def _chat(client, stream: bool, **kwargs):
    """The whole completion, or the one the SDK accumulates from the stream (which its helper
    hands over inside the error it raises for ``finish_reason: length``)."""
    if not stream:
        return await client.chat.completions.create(**kwargs)
    async with client.chat.completions.stream(**kwargs) as s:
        try:
            return await s.get_final_completion()
        except openai.LengthFinishReasonError as cut:
            return cut.completion


async def _response(client, stream: bool, **kwargs):
    """The whole response, or the one the stream's last event carries (``response.completed``
    or ``response.incomplete``: the SDK's ``get_final_response`` wants the former)."""
    if not stream:
        return await client.responses.create(**kwargs)
    async with client.responses.stream(**kwargs) as s:
        events = [event async for event in s]
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    return events[-1].response


async def _message(client, stream: bool, **kwargs):
    if not stream:
        return await client.messages.create(**kwargs)
    async with client.messages.stream(**kwargs) as s:
        return await s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_returns_the_cut_call_as_far_as_it_got(stream, openai_on_fake):
    client, _ = openai_on_fake(REPLY)
    out = await _chat(client, stream, model="fake-model", messages=ASK, tools=[OPENAI_TOOL],
                      tool_choice="required", max_tokens=INSIDE)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "length"
    assert [c.function.arguments for c in calls] == [PARIS, '{"city": "Rome", "unit": "']
    out = await _chat(client, stream, model="fake-model", messages=ASK, tools=[OPENAI_TOOL],
                      tool_choice="required", max_tokens=BETWEEN)
    assert out.choices[0].finish_reason == "length"
    assert [c.function.arguments for c in out.choices[0].message.tool_calls] == [PARIS]


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_marks_only_the_cut_call_incomplete(stream, openai_on_fake):
    client, _ = openai_on_fake(REPLY)
    out = await _response(client, stream, model="fake-model", input="Weather?",
                          tools=[RESPONSES_TOOL], tool_choice="required",
                          max_output_tokens=INSIDE)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert [(c.arguments, c.status) for c in out.output] == [
        (PARIS, "completed"), ('{"city": "Rome", "unit": "', "incomplete")]
    out = await _response(client, stream, model="fake-model", input="Weather?",
                          tools=[RESPONSES_TOOL], tool_choice="required",
                          max_output_tokens=BETWEEN)
    assert out.status == "incomplete"
    assert [(c.arguments, c.status) for c in out.output] == [(PARIS, "completed")]


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_returns_the_cut_tool_use_as_its_sdk_accumulates_it(stream):
    client, _ = _anthropic(REPLY)
    out = await _message(client, stream, model="fake-model", messages=ASK,
                         tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"}, max_tokens=INSIDE)
    assert out.stop_reason == "max_tokens"
    assert [b.input for b in out.content] == [{"city": "Paris", "unit": "c"}, {"city": "Rome"}]
    out = await _message(client, stream, model="fake-model", messages=ASK,
                         tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"}, max_tokens=BETWEEN)
    assert out.stop_reason == "max_tokens"
    assert [b.input for b in out.content] == [{"city": "Paris", "unit": "c"}]


async def test_a_cut_call_just_begun_has_an_empty_input():
    """Cut right after its opening markup, before any argument: the stream has opened the block
    (with ``input: {}``), and the whole message has it too."""
    head = len('<tool_call>\n{"name": "get_weather", "arguments": ')
    for stream in (False, True):
        out = await _message(_anthropic(FIRST)[0], stream, model="fake-model", messages=ASK,
                             tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"},
                             max_tokens=head + 1)
        assert [(b.type, b.input) for b in out.content] == [("tool_use", {})], stream


@pytest.mark.parametrize("stream", [False, True])
async def test_a_named_choice_asks_the_engine_for_one_call_in_every_protocol(stream,
                                                                             openai_on_fake):
    """The grammar each protocol sends for a named choice with parallel calls on (their
    default) admits one call: its start rule is a single call, not a list."""
    client, engine = openai_on_fake(FIRST)
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = await _chat(client, stream, model="fake-model", messages=ASK, tools=[OPENAI_TOOL],
                      tool_choice=named, max_tokens=200)
    assert out.choices[0].finish_reason == "stop" and len(out.choices[0].message.tool_calls) == 1
    grammars = [engine.requests[-1].controller.arg]
    await _response(client, stream, model="fake-model", input="Weather?", tools=[RESPONSES_TOOL],
                    tool_choice={"type": "function", "name": "get_weather"},
                    max_output_tokens=200)
    grammars.append(engine.requests[-1].controller.arg)
    claude, claudes_engine = _anthropic(FIRST)
    out = await _message(claude, stream, model="fake-model", messages=ASK, tools=[ANTHROPIC_TOOL],
                         tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=200)
    assert out.stop_reason == "tool_use" and len(out.content) == 1
    grammars.append(claudes_engine.requests[-1].controller.arg)
    for grammar in grammars:
        assert '"start: call\\n' in grammar, grammar

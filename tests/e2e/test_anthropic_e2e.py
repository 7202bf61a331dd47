"""Anthropic's Messages API end to end: the anthropic SDK → HAProxy → the model's own Serve
application → vLLM (embedded model). Oracles: vLLM's own greedy text through the OpenAI path
for the same rendered prompt, ``jsonschema`` for every tool call, the SDK's stream
accumulation against the whole message."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": SCHEMA}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# The SDK's create() no longer has sampling arguments; the API (and this gateway) still reads
# them from the body.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(gateway_url):
    return anthropic.Anthropic(base_url=gateway_url, api_key="unused", max_retries=0, timeout=120)


def test_text_equals_vllms_own_greedy_answer_and_the_stream_accumulates_to_it(client,
                                                                             openai_client):
    message = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK,
                                     system="You are a helpful assistant.")
    oracle = openai_client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "You are a helpful assistant."}, *ASK])
    assert message.content[0].text == oracle.choices[0].message.content
    assert message.usage.input_tokens == oracle.usage.prompt_tokens
    assert message.usage.output_tokens == oracle.usage.completion_tokens
    with client.messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK,
                                system="You are a helpful assistant.") as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == message.content[0].text
    assert streamed.stop_reason == message.stop_reason
    assert streamed.usage.input_tokens == message.usage.input_tokens


def test_a_tool_round_trip_with_the_sdk(client):
    first = client.messages.create(model=MODEL, max_tokens=120, extra_body=GREEDY, messages=ASK,
                                   tools=[WEATHER], tool_choice={"type": "any",
                                                                 "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use", first
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, SCHEMA)
    second = client.messages.create(
        model=MODEL, max_tokens=40, extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "none"},
        messages=[*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": json.dumps({"temperature": 21})}]}])
    assert second.content and second.content[0].type == "text" and second.content[0].text
    assert second.stop_reason in ("end_turn", "max_tokens")


def test_a_named_tool_is_exactly_one_tool_use_whole_and_streamed(client):
    """``tool_choice: tool`` with parallel tool use left on and a small ``max_tokens``: one
    ``tool_use`` block that validates, ``stop_reason: tool_use``; the SDK's stream accumulation
    gives the same block."""
    kwargs = dict(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"})
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        [use] = message.content
        assert use.type == "tool_use" and use.name == "get_weather", message
        assert message.stop_reason == "tool_use"
        jsonschema.validate(use.input, SCHEMA)
    assert streamed.content[0].input == whole.content[0].input


def test_structured_output_is_json_that_follows_the_schema(client):
    """``output_config.format`` (Anthropic's structured outputs): the answer's text block is
    JSON that the schema accepts, whole and streamed alike."""
    kwargs = dict(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ASK,
                  output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    message = client.messages.create(**kwargs)
    [block] = message.content
    assert block.type == "text" and message.stop_reason == "end_turn", message
    jsonschema.validate(json.loads(block.text), SCHEMA)
    with client.messages.stream(**kwargs) as stream:
        assert stream.get_final_message().content[0].text == block.text


def test_a_streamed_tool_call_accumulates_to_the_whole_one(client):
    kwargs = dict(model=MODEL, max_tokens=120, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather",
                               "disable_parallel_tool_use": True})
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    pairs = [[(b.name, b.input) for b in m.content if b.type == "tool_use"]
             for m in (whole, streamed)]
    assert pairs[0] == pairs[1] and len(pairs[0]) == 1
    jsonschema.validate(pairs[0][0][1], SCHEMA)
    assert streamed.stop_reason == whole.stop_reason == "tool_use"


def test_count_tokens_and_errors_in_anthropics_shape(client, openai_client):
    counted = client.messages.count_tokens(model=MODEL, messages=ASK)
    oracle = openai_client.chat.completions.create(model=MODEL, max_tokens=1, messages=ASK)
    assert counted.input_tokens == oracle.usage.prompt_tokens
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=5, messages=ASK)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=5, messages=ASK, tools=[
            {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": 1}}}}])
    assert info.value.body["error"]["type"] == "invalid_request_error"

"""OpenAI's Responses API end to end: the openai SDK (``responses.create`` and
``responses.stream``) → HAProxy → the model's own application → vLLM (embedded model).
Oracles: vLLM's own greedy text for the same conversation through chat completions,
``jsonschema`` for calls and ``text.format``, the SDK's stream accumulation."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
          "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": SCHEMA}
QUESTION = "What is the weather like in Paris today?"


def test_text_equals_vllms_own_greedy_answer_and_streams_to_it(openai_client):
    whole = openai_client.responses.create(model=MODEL, instructions="Be brief.", input=QUESTION,
                                           max_output_tokens=24, temperature=0)
    oracle = openai_client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    assert whole.output_text == oracle.choices[0].message.content
    assert whole.usage.input_tokens == oracle.usage.prompt_tokens
    with openai_client.responses.stream(model=MODEL, instructions="Be brief.", input=QUESTION,
                                        max_output_tokens=24, temperature=0) as stream:
        events = list(stream)
    # Cut off by max_output_tokens, the stream ends with response.incomplete, as OpenAI's
    # does (the SDK's get_final_response() then raises: it waits for response.completed).
    ending = {"completed": "response.completed", "incomplete": "response.incomplete"}
    assert events[-1].type == ending[whole.status]
    assert events[-1].response.output[0].content[0].text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        whole.output_text


def test_a_named_function_is_exactly_one_call_whole_and_streamed(openai_client):
    """``parallel_tool_calls`` at its default (on), a small token limit: one call that validates,
    and the stream's ``response.completed`` carries the same."""
    kwargs = dict(model=MODEL, input=QUESTION, tools=[WEATHER], max_output_tokens=60,
                  temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    whole = openai_client.responses.create(**kwargs)
    with openai_client.responses.stream(**kwargs) as stream:
        streamed = stream.get_final_response()
    for out in (whole, streamed):
        [call] = out.output
        assert call.type == "function_call" and call.name == "get_weather", out
        assert out.status == call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMA)
    assert streamed.output[0].arguments == whole.output[0].arguments


def test_a_function_call_round_trip_and_the_stream_accumulates_to_the_whole_call(openai_client):
    kwargs = dict(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    first = openai_client.responses.create(**kwargs)
    [call] = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    with openai_client.responses.stream(**kwargs) as stream:
        streamed = stream.get_final_response()
    [again] = [item for item in streamed.output if item.type == "function_call"]
    assert (again.name, again.arguments) == (call.name, call.arguments)
    second = openai_client.responses.create(
        model=MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=30, temperature=0,
        input=[{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temperature": 21})}])
    assert second.output_text and not [i for i in second.output if i.type == "function_call"]


def test_text_format_json_schema_validates(openai_client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=60, temperature=0,
                  text={"format": {"type": "json_schema", "name": "weather", "schema": schema}})
    out = openai_client.responses.create(**kwargs)
    jsonschema.validate(json.loads(out.output_text), schema)
    with openai_client.responses.stream(**kwargs) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == out.output_text


def test_stored_responses_continue_a_conversation_on_any_application(openai_client):
    """``previous_response_id`` as vLLM's own greedy answer to the whole conversation; the
    model's application stores, the gateway's answers ``GET`` (it names no model): one store."""
    first = openai_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16,
                                           temperature=0)
    second = openai_client.responses.create(model=MODEL, input="Say it in French.",
                                            previous_response_id=first.id,
                                            max_output_tokens=16, temperature=0)
    oracle = openai_client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0, messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Say it in French."}])
    assert second.output_text == oracle.choices[0].message.content
    assert second.previous_response_id == first.id and second.store is True
    kept = openai_client.responses.retrieve(second.id)
    assert (kept.id, kept.output_text) == (second.id, second.output_text)
    items = openai_client.responses.input_items.list(second.id)
    assert [item.content[0].text for item in items.data] == ["Say it in French."]
    openai_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.create(model=MODEL, input="x", previous_response_id=first.id)

"""Stored responses (docs/protocols/responses.md, "Stored responses"), read by the openai SDK
over the fake engine: ``previous_response_id`` continues a conversation, ``retrieve``,
``input_items.list`` and ``delete``; the store's byte bound."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.registry import ModelRegistry
from protocols.internal import ToolCall
from protocols.responses.store import ResponseCache, StoredResponse
from tests.fake_engine import FakeEngine
from tests.unit.test_responses import CALL, WEATHER

pytestmark = pytest.mark.usefixtures("long_context")


def _roles(engine) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in engine.requests[-1].prompt.messages]


async def test_previous_response_id_continues_the_conversation(openai_on_fake):
    client, engine = openai_on_fake("Hello world")
    first = await client.responses.create(model="fake-model", input="Hi",
                                          instructions="Be brief.")
    assert first.store is True and first.previous_response_id is None
    second = await client.responses.create(model="fake-model", input="And then?",
                                           previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The first turn and its answer come first; its instructions do not carry over (OpenAI's).
    assert _roles(engine) == [("user", "Hi"), ("assistant", "Hello world"),
                              ("user", "And then?")]
    third = await client.responses.create(model="fake-model", input="More.",
                                          instructions="Be kind.", previous_response_id=second.id)
    assert third.output_text == "Hello world"
    assert _roles(engine) == [("system", "Be kind."), ("user", "Hi"),
                              ("assistant", "Hello world"), ("user", "And then?"),
                              ("assistant", "Hello world"), ("user", "More.")]


async def test_retrieve_input_items_and_delete(openai_on_fake):
    client, _ = openai_on_fake()
    made = await client.responses.create(model="fake-model", input=[
        {"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    assert (await client.responses.retrieve(made.id)).model_dump() == made.model_dump()
    items = await client.responses.input_items.list(made.id)
    assert [item.content for item in items.data] == ["two", "one"]  # OpenAI's default: desc
    ascending = await client.responses.input_items.list(made.id, order="asc", limit=1)
    assert [item.content for item in ascending.data] == ["one"] and ascending.has_more
    deleted = await client.responses.delete(made.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model="fake-model", input="x", previous_response_id=made.id)
    assert info.value.body["param"] == "previous_response_id"


async def test_a_streamed_response_is_stored_as_its_last_event_says(openai_on_fake):
    client, _ = openai_on_fake("Hello world")
    async with client.responses.stream(model="fake-model", input="Hi") as stream:
        final = await stream.get_final_response()
    kept = await client.responses.retrieve(final.id)
    # (the stream's final response is the SDK's parsed kind, with a field of its own)
    assert (kept.id, kept.status, kept.output_text, kept.usage) == (
        final.id, final.status, final.output_text, final.usage)
    assert [item.id for item in kept.output] == [item.id for item in final.output]


async def test_store_false_keeps_nothing(openai_on_fake):
    client, _ = openai_on_fake()
    made = await client.responses.create(model="fake-model", input="Hi", store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.retrieve(made.id)
    assert info.value.body["param"] == "response_id"


async def test_a_function_call_answered_in_the_next_request(openai_on_fake):
    client, engine = openai_on_fake(CALL)
    asked = await client.responses.create(model="fake-model", input="Weather in Paris?",
                                          tools=[WEATHER])
    (call,) = [item for item in asked.output if item.type == "function_call"]
    engine.model.reply = "Sunny."
    answered = await client.responses.create(
        model="fake-model", tools=[WEATHER], previous_response_id=asked.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answered.output_text == "Sunny."
    messages = engine.requests[-1].prompt.messages
    assert messages[1].tool_calls == (ToolCall(id=call.call_id, name="get_weather",
                                               arguments=call.arguments),)
    assert (messages[2].role, messages[2].content) == ("tool", "sunny")


async def test_a_gateway_storing_nothing_says_so():
    engine = FakeEngine(reply="x")
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig(stored_responses_mib=0))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        made = (await c.post("/v1/responses", json={"input": "Hi"})).json()
        assert made["store"] is False
        again = await c.post("/v1/responses", json={"input": "Hi",
                                                    "previous_response_id": made["id"]})
        assert again.status_code == 404 and again.json()["error"]["param"] == \
            "previous_response_id"
        listed = await c.get(f"/v1/responses/{made['id']}/input_items", params={"limit": 0})
        assert listed.status_code == 400 and listed.json()["error"]["param"] == "limit"


def _stored(response_id: str, text: str) -> StoredResponse:
    return StoredResponse(response={"id": response_id}, input_items=[{"content": text}],
                          context=[])


def test_the_cache_drops_the_least_recently_used_within_its_bytes():
    size = len(__import__("msgspec").json.encode(_stored("a", "x" * 100)))
    cache = ResponseCache(max_bytes=2 * size)
    assert cache.put(_stored("a", "x" * 100)) and cache.put(_stored("b", "y" * 100))
    assert cache.get("a") is not None  # a is now the more recent
    assert cache.put(_stored("c", "z" * 100))
    assert cache.get("b") is None and cache.get("a") and cache.get("c")
    assert cache.bytes == 2 * size and len(cache) == 2
    assert not cache.put(_stored("huge", "x" * (3 * size)))  # larger than the store: not kept
    assert cache.put(_stored("a", "w" * 100)) and len(cache) == 2 and cache.bytes == 2 * size
    assert cache.delete("a") and not cache.delete("a") and cache.bytes == size

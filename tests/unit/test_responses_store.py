"""Stored responses (docs/protocols/responses.md, "Stored responses"), read by the openai SDK
over the fake engine: ``previous_response_id`` continues a conversation, ``retrieve``,
``input_items.list`` and ``delete``; the store's byte bound."""

from __future__ import annotations

import httpx
import openai
import pytest

from contract import ToolCall
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.keys import ApiKey
from gateway.ingress.registry import ModelRegistry
from protocols.responses.store import MemoryStore, ResponseCache, StoredResponse, encode
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
    # OpenAI's default order is newest first; a message's text comes back as content parts.
    assert [item.content[0].text for item in items.data] == ["two", "one"]
    assert all(item.type == "message" and item.status == "completed" and item.id
               and item.content[0].type == "input_text" for item in items.data)
    assert (items.first_id, items.last_id, items.has_more) == (
        items.data[0].id, items.data[-1].id, False)
    ascending = await client.responses.input_items.list(made.id, order="asc", limit=1)
    assert [item.content[0].text for item in ascending.data] == ["one"] and ascending.has_more
    rest = await client.responses.input_items.list(made.id, order="asc",
                                                   after=ascending.data[0].id)
    assert [item.content[0].text for item in rest.data] == ["two"] and not rest.has_more
    deleted = await client.responses.with_raw_response.delete(made.id)
    assert deleted.http_response.json() == {"id": made.id, "object": "response",
                                            "deleted": True}
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(made.id)
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


async def test_a_cut_off_call_is_left_out_and_old_calls_need_not_match_the_new_tools(
        openai_on_fake):
    client, engine = openai_on_fake(CALL)
    cut = await client.responses.create(model="fake-model", input="Weather?", tools=[WEATHER],
                                        max_output_tokens=CALL.index("Paris") + 2)  # mid-value
    assert cut.status == "incomplete" and cut.output[-1].type == "function_call"
    done = await client.responses.create(model="fake-model", input="Weather in Paris?",
                                         tools=[WEATHER])
    (call,) = [item for item in done.output if item.type == "function_call"]
    engine.model.reply = "Fine."
    # The cut-off call is not part of the context; the finished one stays, though this
    # request names no tools.
    again = await client.responses.create(model="fake-model", input="Thanks.",
                                          previous_response_id=cut.id)
    assert again.output_text == "Fine."
    assert _roles(engine) == [("user", "Weather?"), ("user", "Thanks.")]
    answered = await client.responses.create(
        model="fake-model", previous_response_id=done.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answered.output_text == "Fine."


def _clients(app, *keys: str) -> list[openai.AsyncOpenAI]:
    return [openai.AsyncOpenAI(
        base_url="http://gw/v1", api_key=key, max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                      base_url="http://gw/v1")) for key in keys]


async def test_a_stored_response_is_seen_by_the_key_that_made_it_only():
    engine = FakeEngine(reply="Hello")
    config = GatewayConfig(api_keys=[ApiKey(key="alice-key"), ApiKey(key="bob-key")])
    store = MemoryStore(config.stored_responses_bytes)
    alice, bob, alice_again = _clients(create_app(ModelRegistry({"fake-model": engine}), config,
                                                  response_store=store),
                                       "alice-key", "bob-key", "alice-key")
    made = await alice.responses.create(model="fake-model", input="my secret")
    streamed = await alice.responses.create(model="fake-model", input="more", stream=True)
    ids = [made.id, [e async for e in streamed][-1].response.id]
    for response_id in ids:
        # Another key finds nothing, as with an id never made: 404, in OpenAI's shape.
        for refused in (bob.responses.retrieve(response_id),
                        bob.responses.input_items.list(response_id),
                        bob.responses.delete(response_id),
                        bob.responses.create(model="fake-model", input="What did they say?",
                                             previous_response_id=response_id)):
            with pytest.raises(openai.NotFoundError):
                await refused
        assert (await alice_again.responses.retrieve(response_id)).id == response_id
    # Bob's failed attempts sent nothing to the engine and deleted nothing.
    assert len(engine.requests) == 2 and len(store.cache) == 2
    # No store holds a key: what it keeps names its owner by a digest.
    assert all(b"alice-key" not in raw for raw in store.cache._entries.values())
    assert (await alice.responses.create(model="fake-model", input="go on",
                                         previous_response_id=made.id)).output_text == "Hello"


class _Failing:
    async def get(self, response_id):
        raise ConnectionError("the store's actor is restarting")

    put = delete = get


async def test_a_store_that_fails_withholds_no_answer_and_reads_are_503s():
    engine = FakeEngine(reply="Hello")
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig(),
                     response_store=_Failing())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        made = await c.post("/v1/responses", json={"input": "Hi"})
        assert made.status_code == 200 and made.json()["output"][0]["content"][0]["text"] == \
            "Hello"
        streamed = await c.post("/v1/responses", json={"input": "Hi", "stream": True})
        assert streamed.status_code == 200 and "response.completed" in streamed.text
        for method, path in (("GET", f"/v1/responses/{made.json()['id']}"),
                             ("DELETE", f"/v1/responses/{made.json()['id']}")):
            r = await c.request(method, path)
            assert r.status_code == 503 and r.json()["error"]["message"]
        r = await c.post("/v1/responses", json={"input": "x",
                                                "previous_response_id": made.json()["id"]})
        assert r.status_code == 503 and not engine.requests[2:]


def test_the_cache_drops_the_least_recently_used_within_its_bytes():
    cache = ResponseCache(max_bytes=200)
    assert cache.put("a", b"x" * 100) and cache.put("b", b"y" * 100)
    assert cache.get("a") == b"x" * 100  # a is now the more recent
    assert cache.put("c", b"z" * 100)
    assert cache.get("b") is None and cache.get("a") and cache.get("c")
    assert cache.bytes == 200 and len(cache) == 2
    assert not cache.put("huge", b"x" * 201)  # larger than the store: not kept
    assert cache.put("a", b"w" * 50) and len(cache) == 2 and cache.bytes == 150
    assert cache.delete("a") and not cache.delete("a") and cache.bytes == 100


async def test_the_memory_store_keeps_what_it_is_given():
    store = MemoryStore(max_bytes=1 << 20)
    stored = StoredResponse(response={"id": "resp_1", "output": []},
                            input_items=[{"type": "message", "role": "user", "content": "é"}],
                            context=[])
    assert await store.put(stored) and await store.get("resp_1") == stored
    assert store.cache.bytes == len(encode(stored))

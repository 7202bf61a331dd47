"""AICI's REST API (``docs/protocols/aici.md``, "REST API") over the fake engine: the SSE shape pyaici reads,
controller resolution (tags, module ids, ``none``), tags and their rules, errors as
``APIError:`` plain text."""

from __future__ import annotations

import json

import httpx
import pytest

from contract import (
    BacktrackEvent,
    ErrorEvent,
    FinalEvent,
    ForkEvent,
    TokenEvent,
    TokenPrompt,
    Usage,
)
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from protocols.aici.encode import BACKTRACK_MARK, RunMeta, run_objects, sse
from tests.fake_engine import FAKE_SPLICE_ID, MAX_MODEL_LEN, FakeEngine

META = RunMeta(id="run-1", model="m", created=7, prompt_tokens=3, controlled=True)
USAGE = Usage(prompt_tokens=3, completion_tokens=2)


async def _objects(events, meta=META) -> list[dict]:
    async def source():
        for event in events:
            yield event
    return [o async for o in run_objects(source(), meta)]


def _lines(body: bytes) -> list[str]:
    """The SSE body as pyaici reads it: every non-empty line."""
    return [line for line in body.decode().split("\n") if line]


def _parsed(body: bytes) -> list[dict]:
    lines = _lines(body)
    assert lines[-1] == "data: [DONE]", lines
    assert all(line.startswith("data: {") for line in lines[:-1]), lines
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# --- the encoder ------------------------------------------------------------------------------

async def test_run_objects_are_aicis_shape_with_cumulative_usage():
    objects = await _objects([
        TokenEvent(token_id=1, text="ab", forced=True),
        TokenEvent(token_id=2, text="c"),
        TokenEvent(token_id=3, text="d", last=True),
        FinalEvent(finish_reason="eos", usage=USAGE, text="!"),
    ])
    assert objects[0] == {"id": "run-1", "object": "initial-run", "created": 7, "model": "m"}
    runs = objects[1:]
    assert [r["object"] for r in runs] == ["run"] * 4
    assert [r["forks"][0]["text"] for r in runs] == ["ab", "c", "d", "!"]
    assert runs[0]["forks"][0] == {"index": 0, "text": "ab", "error": "", "logs": "",
                                   "storage": [], "micros": 0}
    # ff_tokens counts the prompt and forced tokens; cost = 2 * sampled + ff.
    assert [r["usage"] for r in runs] == [
        {"sampled_tokens": 0, "ff_tokens": 4, "cost": 4},
        {"sampled_tokens": 1, "ff_tokens": 4, "cost": 6},
        {"sampled_tokens": 2, "ff_tokens": 4, "cost": 8},
        {"sampled_tokens": 2, "ff_tokens": 4, "cost": 8}]
    final = runs[-1]["forks"][0]
    assert list(final)[:2] == ["index", "finish_reason"] and final["finish_reason"] == "aici-stop"


@pytest.mark.parametrize(("reason", "controlled", "expected"), [
    ("eos", True, "aici-stop"), ("eos", False, "eos"), ("length", True, "length"),
    ("abort", False, "abort"), ("error", True, "fail")])
async def test_finish_reasons_use_aicis_names(reason, controlled, expected):
    meta = RunMeta(id="r", model="m", created=0, prompt_tokens=1, controlled=controlled)
    objects = await _objects([FinalEvent(finish_reason=reason, usage=USAGE)], meta)
    assert objects[-1]["forks"][0]["finish_reason"] == expected


async def test_a_backtrack_marks_the_text_and_a_fork_opens_a_new_index():
    objects = await _objects([
        TokenEvent(token_id=1, text="xy"),
        BacktrackEvent(count=1, text="y"),
        TokenEvent(token_id=2, text="z"),
        ForkEvent(index=1, parent=0),
        TokenEvent(index=1, token_id=3, text="w"),
        FinalEvent(index=1, finish_reason="length", usage=USAGE),
        FinalEvent(index=0, finish_reason="length", usage=USAGE),
    ])
    texts: dict[int, str] = {}
    for run in objects[1:]:
        for fork in run["forks"]:
            texts[fork["index"]] = texts.get(fork["index"], "") + fork["text"]
    # nothing retracted, as AICI; the fork starts with its parent's text as it stands
    assert texts == {0: "xy" + BACKTRACK_MARK + "z", 1: "xzw"}


async def test_an_error_fails_every_running_fork_and_the_stream_still_ends_with_done():
    async def source():
        yield TokenEvent(token_id=1, text="a")
        yield ForkEvent(index=1)
        yield ErrorEvent(kind="engine", message="boom")

    body = b"".join([chunk async for chunk in sse(run_objects(source(), META))])
    last = _parsed(body)[-1]
    assert [(f["index"], f["finish_reason"], f["error"]) for f in last["forks"]] == [
        (0, "fail", "boom"), (1, "fail", "boom")]
    # the fork's first entry is its parent's text
    assert [(f["index"], f["text"]) for run in _parsed(body)[1:-1] for f in run["forks"]] == [
        (0, "a"), (1, "a")]
    # Compact JSON, one object per event, as AICI's server writes it.
    assert body.startswith(b'data: {"id":"run-1","object":"initial-run","created":7,'
                           b'"model":"m"}\n\n')
    assert body.endswith(b"\n\ndata: [DONE]\n\n")


async def test_every_fork_suspended_ends_the_running_forks_as_a_deadlock():
    async def source():
        yield TokenEvent(token_id=1, text="a")
        yield ForkEvent(index=1)
        yield ErrorEvent(kind="validation", message="deadlock: all wait", param="deadlock")

    objects = [o async for o in run_objects(source(), META)]
    assert [f["index"] for f in objects[2]["forks"]] == [1] and objects[2]["forks"][0]["text"] == "a"
    assert [(f["index"], f["finish_reason"]) for f in objects[-1]["forks"]] == [
        (0, "deadlock"), (1, "deadlock")]


# --- the routes over the fake engine -----------------------------------------------------------

@pytest.fixture
def controlled() -> FakeEngine:
    return FakeEngine(controllers="splice")


@pytest.fixture
async def aici(controlled):
    app = create_app(ModelRegistry({"fake-model": controlled}), GatewayConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as c:
        yield c


async def test_a_controlled_run_streams_forced_and_sampled_text(aici, controlled):
    r = await aici.post("/v1/run", json={"controller": "fake-splice",
                                         "controller_arg": {"ff": "ab"}, "max_tokens": 5,
                                         "prompt": "Hi"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    objects = _parsed(r.content)
    assert objects[0]["object"] == "initial-run" and objects[0]["id"].startswith("run-")
    assert "".join(f["text"] for o in objects[1:] for f in o["forks"]) == "abHel"
    assert objects[-1]["forks"][0]["finish_reason"] == "length"
    assert objects[-1]["usage"] == {"sampled_tokens": 3, "ff_tokens": 4, "cost": 10}
    sent = controlled.requests[-1]
    assert sent.request_id == objects[0]["id"]
    assert sent.prompt == TokenPrompt(token_ids=(ord("H"), ord("i")))
    assert sent.controller.module == "fake-splice" and json.loads(sent.controller.arg) == {
        "ff": "ab"}
    assert sent.sampling.ignore_eos and sent.sampling.temperature == 0
    assert sent.sampling.max_tokens == 5 and sent.output.splices == "full"


async def test_none_is_plain_generation_of_the_argument_up_to_the_context(aici, controlled):
    r = await aici.post("/v1/run", json={"controller": "none", "controller_arg": "Hey",
                                         "temperature": 0.5, "top_k": -1})
    objects = _parsed(r.content)
    sent = controlled.requests[-1]
    assert sent.controller is None and sent.prompt == TokenPrompt(token_ids=(72, 101, 121))
    assert sent.sampling.max_tokens == MAX_MODEL_LEN - 3  # AICI's default: the context's rest
    assert sent.sampling.top_k == 0 and sent.sampling.temperature == 0.5
    assert objects[-1]["forks"][0]["finish_reason"] == "length"


async def test_an_empty_prompt_starts_from_the_models_end_of_text_token(aici, controlled):
    await aici.post("/v1/run", json={"controller": "fake-splice", "max_tokens": 2})
    assert controlled.requests[-1].prompt == TokenPrompt(token_ids=(0,))


async def test_a_controller_that_fails_to_start_fails_in_the_stream(aici):
    r = await aici.post("/v1/run", json={"controller": "fake-splice",
                                         "controller_arg": {"fail": "bad program"}})
    assert r.status_code == 200
    objects = _parsed(r.content)
    assert objects[0]["object"] == "initial-run"
    fork = objects[-1]["forks"][0]
    assert fork["finish_reason"] == "fail" and "bad program" in fork["error"]


async def test_splices_reach_the_stream(aici):
    r = await aici.post("/v1/run", json={"controller": FAKE_SPLICE_ID, "max_tokens": 3,
                                         "controller_arg": {"backtrack": 1, "fork": 1}})
    objects = _parsed(r.content)
    texts: dict[int, str] = {}
    for o in objects[1:]:
        for f in o["forks"]:
            texts[f["index"]] = texts.get(f["index"], "") + f["text"]
    assert texts[0] == "Hel" + BACKTRACK_MARK + "!"
    finished = {f["index"] for o in objects[1:] for f in o["forks"] if "finish_reason" in f}
    assert finished == {0, 1}


@pytest.mark.parametrize(("body", "needle"), [
    (b"{", "invalid request body"),
    (b'{"controller_arg": "x"}', "controller"),
    (b'{"controller": "none", "bogus": 1}', "bogus"),
    (b'{"controller": "none", "temperature": -1}', "temperature"),
    (b'{"controller": "none", "top_p": 0}', "top_p"),
    (b'{"controller": "none", "max_tokens": 0}', "max_tokens"),
    (b'{"controller": "none", "controller_arg": "Hi", "max_tokens": 1000}', "context"),
    (b'{"controller": "gh:microsoft/aici/declctrl"}', "not downloaded"),
    (b'{"controller": "none", "model": "nope"}', "nope"),
    (b'{"controller": "none", "controller_arg": 7}', "controller_arg"),
    (b'{"controller": "fake-splice", "controller_arg": 7}', "controller_arg"),
])
async def test_bad_runs_get_a_plain_text_api_error(aici, body, needle):
    r = await aici.post("/v1/run", content=body)
    assert r.status_code in (400, 404), r.text
    assert r.headers["content-type"].startswith("text/plain")
    assert r.text.startswith("APIError: ") and needle in r.text, r.text


async def test_a_model_without_controllers_refuses_a_controller_but_runs_none(client):
    r = await client.post("/v1/run", json={"controller": "llguidance", "controller_arg": "{}"})
    assert r.status_code == 400 and "runs no controllers" in r.text
    r = await client.post("/v1/run", json={"controller": "none", "controller_arg": "Hi",
                                           "max_tokens": 2})
    assert r.status_code == 200 and _parsed(r.content)[-1]["forks"][0]["finish_reason"]


async def test_tags_list_set_and_resolve(aici, controlled):
    tags = (await aici.get("/v1/controllers/tags")).json()["tags"]
    assert [(t["tag"], t["module_id"], t["updated_by"]) for t in tags] == [
        ("fake-splice", FAKE_SPLICE_ID, "builtin")]
    assert set(tags[0]) == {"tag", "module_id", "updated_at", "updated_by", "wasm_size",
                            "compiled_size"}
    r = await aici.post("/v1/controllers/tags", json={"module_id": FAKE_SPLICE_ID,
                                                      "tags": ["alice.mine"]},
                        headers={"x-user-id": "alice", "x-user-role": "user"})
    assert r.status_code == 200, r.text
    assert [(t["tag"], t["updated_by"]) for t in r.json()["tags"]] == [("alice.mine", "alice")]
    listed = (await aici.get("/v1/controllers/tags")).json()["tags"]
    assert listed[0]["tag"] == "alice.mine"  # newest first
    await aici.post("/v1/run", json={"controller": "alice.mine", "max_tokens": 1})
    assert controlled.requests[-1].controller.module == FAKE_SPLICE_ID


@pytest.mark.parametrize(("body", "headers", "needle"), [
    ({"module_id": FAKE_SPLICE_ID, "tags": ["theirs"]},
     {"x-user-id": "alice", "x-user-role": "user"}, "permission denied"),
    ({"module_id": "0" * 64, "tags": ["x"]}, {}, "unknown module_id"),
    ({"module_id": FAKE_SPLICE_ID, "tags": []}, {}, "empty"),
    ({"module_id": FAKE_SPLICE_ID, "tags": ["a b"]}, {}, "invalid tag"),
    ({"module_id": FAKE_SPLICE_ID, "tags": ["ab" * 16]}, {}, "invalid tag"),
    ({"module_id": FAKE_SPLICE_ID, "tags": ["alice.x\n"]}, {}, "invalid tag"),
    ({"module_id": FAKE_SPLICE_ID, "tags": ["fake-splice"]}, {}, "built-in"),
    ({"module_id": FAKE_SPLICE_ID, "tags": [f"t{i}" for i in range(17)]}, {}, "at most 16"),
])
async def test_bad_tags_are_refused(aici, body, headers, needle):
    r = await aici.post("/v1/controllers/tags", json=body, headers=headers)
    assert r.status_code == 400 and r.text.startswith("APIError: ") and needle in r.text, r.text


async def test_wasm_upload_and_unknown_routes_answer_in_aicis_shape(aici):
    r = await aici.post("/v1/controllers", content=b"\0asm")
    assert r.status_code == 400 and "fake-splice" in r.text and r.text.startswith("APIError: ")
    r = await aici.get("/v1/controllers/nope")
    assert r.status_code == 404 and r.text.startswith("APIError: ")
    r = await aici.get("/v1/run")
    assert r.status_code == 405 and r.text.startswith("APIError: ")
    # OpenAI's paths keep OpenAI's shape.
    r = await aici.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


async def test_the_api_key_may_come_as_pyaicis_api_key_header(controlled):
    app = create_app(ModelRegistry({"fake-model": controlled}), GatewayConfig(api_key="k"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as c:
        assert (await c.get("/v1/controllers/tags")).status_code == 401
        assert (await c.get("/v1/controllers/tags", headers={"api-key": "no"})).status_code == 401
        r = await c.get("/v1/controllers/tags", headers={"api-key": "k"})
        assert r.status_code == 200


async def test_the_controllers_logs_and_variables_come_with_the_end():
    write = {"WriteVar": {"name": "x", "value": b"42".hex(), "op": "Set",
                          "when_version_is": None}}
    objects = await _objects([
        TokenEvent(token_id=1, text="a", last=True),
        FinalEvent(finish_reason="eos", usage=USAGE, logs="FIXED 'a'\n", storage=(write,)),
    ])
    end = objects[-1]["forks"][0]
    assert end["logs"] == "FIXED 'a'\n" and end["storage"] == [write]
    assert objects[1]["forks"][0]["logs"] == "" and objects[1]["forks"][0]["storage"] == []


async def test_logs_variables_and_micros_ride_on_the_event_that_carries_them():
    write = {"WriteVar": {"name": "x", "value": b"4".hex(), "op": "Append",
                          "when_version_is": None}}
    objects = await _objects([
        TokenEvent(token_id=1, text="a", logs="step 1\n", storage=(write,), micros=120),
        TokenEvent(token_id=2, text="b", last=True),
        FinalEvent(finish_reason="eos", usage=USAGE, logs="end\n", micros=30),
    ])
    forks = [o["forks"][0] for o in objects[1:]]
    assert [(f["logs"], f["storage"], f["micros"]) for f in forks] == [
        ("step 1\n", [write], 120), ("", [], 0), ("end\n", [], 30)]

"""Bounds and failure shapes at the gateway (fake engine, no Ray): the ingress admission limit,
Retry-After, 503 while a model is unavailable, private model paths, the LMTP connection bounds
and the websocket API key LMQL can send."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from contract import (
    EngineUnavailable,
    ErrorEvent,
    GenerateRequest,
    TokenEvent,
)
from gateway.config import GatewayConfig, load_config
from gateway.ingress.asgi import create_app
from gateway.ingress.keys import ApiKey
from gateway.ingress.registry import ModelRegistry
from protocols.lmtp.session import LMTPLimits, LMTPSession
from tests.fake_engine import VOCAB, FakeEngine

COMPLETION = {"model": "fake-model", "prompt": "Hi", "max_tokens": 5}


def _client(engine=None, **config) -> httpx.AsyncClient:
    app = create_app(ModelRegistry({"fake-model": engine or FakeEngine()},
                                   expose_paths=config.get("expose_model_paths", False)),
                     GatewayConfig(**config))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://gw")


# --- ingress admission and Retry-After ----------------------------------------------------

@pytest.mark.parametrize("path, body, check", [
    ("/v1/completions", COMPLETION, lambda j: j["error"]["code"] == 503),
    ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 5}},
     lambda j: j["error_type"] == "generation"),
    ("/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 5}},
     lambda j: j["code"] == 503),
])
async def test_past_the_ingress_limit_requests_get_a_503_in_shape_at_once(path, body, check):
    async with _client(FakeEngine(delay=0.1), max_concurrent_requests=2) as c:
        busy = [asyncio.ensure_future(c.post(path, json=body)) for _ in range(2)]
        await asyncio.sleep(0.1)
        refused = await c.post(path, json=body)
        assert refused.status_code == 503 and check(refused.json()), refused.text
        assert refused.headers["retry-after"] == "1"
        assert (await c.get("/health")).status_code == 200  # probes are not counted
        assert all(r.status_code == 200 for r in await asyncio.gather(*busy))
        assert (await c.post(path, json=body)).status_code == 200  # slots come back


class _Full(FakeEngine):
    async def generate(self, request: GenerateRequest):
        yield ErrorEvent(kind="overloaded", message="model `fake-model` is full; retry later")


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", COMPLETION, 429),
    ("/generate", {"inputs": "Hi"}, 429),
    ("/invocations", {"inputs": "Hi"}, 503),
    ("/v2/models/fake-model/generate", {"text_input": "Hi"}, 503),
])
async def test_a_full_engine_queue_is_429_or_503_with_retry_after(path, body, status):
    async with _client(_Full()) as c:
        r = await c.post(path, json=body)
    assert r.status_code == status and "retry later" in r.text
    assert r.headers["retry-after"] == "1"


class _Starting(FakeEngine):
    async def model_info(self):
        raise EngineUnavailable("fake-model", "no healthy engine replica")


@pytest.mark.parametrize("path, check", [
    ("/v1/models", lambda j: j["error"]["type"] == "ServiceUnavailableError"),
    ("/v2/models/fake-model", lambda j: j["error_type"] == "Service Unavailable"),
])
async def test_listings_answer_503_while_the_engine_is_unavailable(path, check):
    async with _client(_Starting()) as c:
        r = await c.get(path)
    assert r.status_code == 503 and check(r.json()), r.text
    assert "retry later" in r.text and r.headers["retry-after"] == "1"


@pytest.mark.parametrize("expose", [False, True])
async def test_model_paths_are_listed_only_when_configured(expose):
    async with _client(expose_model_paths=expose) as c:
        root = (await c.get("/v1/models")).json()["data"][0]["root"]
        url = (await c.get("/models")).json()["models"][0]["modelUrl"]
    assert root == url == ("/models/fake-model" if expose else "fake-model")


# --- LMTP bounds and the websocket key ----------------------------------------------------

def _ws_app(**config) -> TestClient:
    engine = FakeEngine(delay=0.05, reply="abcdefghijklmnopqrstuvwxyz")
    return TestClient(create_app(ModelRegistry({"fake-model": engine}), GatewayConfig(**config)))


def _generate(ws, stream_id, max_tokens=3, **extra):
    ws.send_text("GENERATE " + json.dumps({"model": "fake-model", "prompt": [1],
                                           "stream_id": stream_id, "max_tokens": max_tokens,
                                           **extra}))


def _until_done(ws, stream_ids):
    """Items per stream until each ended (finish reason or error)."""
    seen: dict = {s: [] for s in stream_ids}
    while any(not v or (v[-1].get("finish_reason") is None and "error" not in v[-1])
              for v in seen.values()):
        kind, _, body = ws.receive_text().partition(" ")
        for item in json.loads(body):
            seen.setdefault(item.get("stream_id"), []).append({**item, "kind": kind})
    return seen


def test_lmtp_refuses_streams_past_the_per_connection_limit_on_token():
    with _ws_app(lmtp_max_streams=2) as client, client.websocket_connect("/lmtp") as ws:
        for stream_id in (1, 2, 3):
            _generate(ws, stream_id, max_tokens=6)
        seen = _until_done(ws, [1, 2, 3])
        assert seen[3] == [{"stream_id": 3, "kind": "TOKEN", "error": (
            "too many concurrent streams on this connection (at most 2); retry when one has "
            "finished")}]
        assert [len(seen[s]) for s in (1, 2)] == [6, 6]
        _generate(ws, 4)  # a slot is free again
        assert _until_done(ws, [4])[4][-1]["finish_reason"] == "length"


def test_lmtp_oversize_frames_get_an_error_and_the_connection_stays():
    with _ws_app(lmtp_max_frame_bytes=1000) as client, client.websocket_connect("/") as ws:
        _generate(ws, 7, padding="x" * 2000)
        [item] = _until_done(ws, [7])[7]
        assert item["kind"] == "TOKEN" and "exceeds the limit of 1000 bytes" in item["error"]
        ws.send_text("GENERATE " + "é" * 600)  # 1,200 bytes in 600 characters, no stream id
        kind, _, body = ws.receive_text().partition(" ")
        assert kind == "MSG" and "exceeds" in json.loads(body)[0]["error"]
        _generate(ws, 8)
        assert _until_done(ws, [8])[8][-1]["finish_reason"] == "length"


def test_lmtp_idle_connections_are_closed():
    with _ws_app(lmtp_idle_timeout_s=0.2) as client, client.websocket_connect("/") as ws:
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
        assert closed.value.code == 1001


@pytest.mark.parametrize("query, accepted", [("?api_key=k", True), ("?api_key=x", False),
                                             ("", False), ("?other=k", False)])
def test_websockets_take_the_key_from_the_query_for_lmql(query, accepted):
    with _ws_app(api_key="k") as client:
        if not accepted:
            with pytest.raises(WebSocketDisconnect):
                with client.websocket_connect("/lmtp" + query) as ws:
                    ws.receive_text()
            return
        with client.websocket_connect("/lmtp" + query) as ws:
            _generate(ws, 1)
            assert _until_done(ws, [1])[1][-1]["finish_reason"] == "length"


def test_http_routes_do_not_take_the_key_from_the_query():
    with _ws_app(api_key="k") as client:
        assert client.post("/v1/completions?api_key=k", json=COMPLETION).status_code == 401


class _SlowSocket:
    """A websocket whose client never reads: every send blocks."""

    def __init__(self, frames: list[str]):
        self.frames = frames
        self.sent = 0
        self.closed = asyncio.Event()

    async def accept(self):
        pass

    async def receive(self):
        if self.frames:
            return {"type": "websocket.receive", "text": self.frames.pop(0)}
        await self.closed.wait()
        return {"type": "websocket.disconnect"}

    async def send_text(self, text):
        await self.closed.wait()

    async def close(self, code=1000, reason=None):
        self.closed.set()


class _Endless:
    """An engine that streams tokens for as long as it is asked; counts what it produced."""

    def __init__(self):
        self.produced = 0
        self.cancelled = False

    async def generate(self, request):
        try:
            while True:
                self.produced += 1
                yield TokenEvent(token_id=5, text="x")
                await asyncio.sleep(0)
        except (GeneratorExit, asyncio.CancelledError):
            self.cancelled = True
            raise


async def test_a_slow_lmtp_reader_stalls_its_streams_instead_of_growing_memory():
    engine = _Endless()
    frames = [f'GENERATE {{"model": "m", "prompt": [1], "stream_id": {i}}}' for i in range(3)]
    socket = _SlowSocket(frames)
    session = LMTPSession(socket, lambda name: ("m", engine), None,
                          LMTPLimits(outbox_items=16, max_streams=8))
    task = asyncio.ensure_future(session.run())
    await asyncio.sleep(0.5)
    # 16 queued + one frame's worth taken by the (blocked) writer + one in each stream's hand.
    assert engine.produced <= 16 + 512 + 3
    before = engine.produced
    await asyncio.sleep(0.2)
    assert engine.produced == before  # stalled, not buffering
    await socket.close()
    await asyncio.wait_for(task, 5)
    assert engine.cancelled  # closing the connection aborted the streams


@pytest.mark.parametrize("path", ["/v1/completions", "/generate", "/invocations",
                                  "/v2/models/fake-model/generate"])
async def test_a_401_names_its_scheme(path):
    async with _client(api_key="k") as c:
        r = await c.post(path, json={"inputs": "Hi"})
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")


def test_tgis_client_reads_a_401_as_what_it_is_not_a_validation_error():
    from text_generation.errors import UnknownError, ValidationError, parse_error

    from protocols.tgi.errors import route_error

    body = json.loads(route_error(401, "invalid or missing API key").body)
    assert body["error_type"] != "validation"
    error = parse_error(401, body)
    assert isinstance(error, UnknownError) and not isinstance(error, ValidationError)


async def test_under_a_route_prefix_probes_stay_public_and_errors_keep_their_shape():
    """Serve mounts apps under prefixes (``/pipeline``): Starlette's path keeps the prefix."""
    app = create_app(ModelRegistry({"fake-model": FakeEngine()}), GatewayConfig(api_key="k"))
    transport = httpx.ASGITransport(app=app, root_path="/pfx")
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        assert (await c.get("/pfx/health")).status_code == 200
        assert (await c.get("/pfx/ping")).status_code == 200
        r = await c.post("/pfx/generate", json={"inputs": "Hi"})
        assert r.status_code == 401 and "error_type" in r.json()  # TGI's shape, not OpenAI's
        r = await c.post("/pfx/generate", json={"inputs": "Hi", "parameters": {"top_k": -5}},
                         headers={"authorization": "Bearer k"})
        assert r.status_code == 422 and r.json()["error_type"] == "validation"


# --- several keys with rate limits --------------------------------------------------------

def _keyed(**config) -> httpx.AsyncClient:
    keys = [ApiKey(key="fast", name="a"), ApiKey(key="slow", name="b", requests_per_s=1),
            ApiKey(key="thrifty", name="c", tokens_per_min=10)]
    return _client(api_keys=keys, **config)


def _bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


async def test_each_key_gets_its_own_request_rate():
    async with _keyed() as c:
        assert (await c.post("/v1/completions", json=COMPLETION,
                             headers=_bearer("slow"))).status_code == 200
        r = await c.post("/generate", json={"inputs": "Hi"}, headers=_bearer("slow"))
        assert r.status_code == 429 and "rate limit of 1 requests/s" in r.json()["error"], r.text
        assert int(r.headers["retry-after"]) >= 1
        for _ in range(5):  # another key is not affected
            assert (await c.post("/v1/completions", json=COMPLETION,
                                 headers=_bearer("fast"))).status_code == 200
        await asyncio.sleep(1.05)
        assert (await c.post("/v1/completions", json=COMPLETION,
                             headers=_bearer("slow"))).status_code == 200


async def test_a_key_over_its_token_budget_is_refused_until_it_refills():
    async with _keyed() as c:
        # 2 prompt + 5 completion tokens: 7 of 10 → still admitted; 14 of 10 → the next is not.
        for _ in range(2):
            r = await c.post("/v1/completions", json=COMPLETION, headers=_bearer("thrifty"))
            assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", json=COMPLETION, headers=_bearer("thrifty"))
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
        assert "token rate limit of 10 tokens/min" in r.json()["error"]["message"]
        r = await c.post("/v2/models/fake-model/generate", json={"text_input": "Hi"},
                         headers=_bearer("thrifty"))
        # The caller's own limit is a 429 in every protocol (MindIE's and LMI's too).
        assert r.status_code == 429 and "token rate limit" in r.json()["error"]  # MindIE's
        assert r.json()["error_type"] == "Too Many Requests"
        r = await c.post("/invocations", json={"inputs": "Hi"}, headers=_bearer("thrifty"))
        # LMI's: refused at the door (the ledger saw the tokens), in DJL's front-end shape.
        assert r.status_code == 429 and "token rate limit" in r.json()["message"]
        assert (await c.post("/v1/completions", json=COMPLETION,
                             headers=_bearer("fast"))).status_code == 200


def test_lmtp_streams_count_against_the_key_given_in_the_url():
    keys = [ApiKey(key="thrifty", tokens_per_min=5)]
    with _ws_app(api_keys=keys) as client, \
            client.websocket_connect("/lmtp?api_key=thrifty") as ws:
        _generate(ws, 1, max_tokens=5)  # 1 + 5 tokens: over the 5 of the budget afterwards
        assert _until_done(ws, [1])[1][-1]["finish_reason"] == "length"
        _generate(ws, 2)
        [item] = _until_done(ws, [2])[2]
        assert item["kind"] == "TOKEN" and "token rate limit" in item["error"]


@pytest.mark.parametrize("keys", [[{"key": "a"}, {"key": "a"}], [{"key": " "}],
                                  [{"key": "a", "requests_per_s": 0}]])
def test_key_lists_are_validated(keys):
    with pytest.raises(ValueError):
        load_config({"api_keys": keys})


# --- bounds on what one request may ask for -------------------------------------------------

class _Counting(FakeEngine):
    def __init__(self):
        super().__init__()
        self.calls = 0

    async def detokenize(self, token_ids):
        self.calls += 1
        return await super().detokenize(token_ids)

    async def detokenize_each(self, token_ids):
        self.calls += 1
        return await super().detokenize_each(token_ids)


async def test_token_strings_are_one_engine_call_not_one_per_token():
    engine = _Counting()
    async with _client(engine) as c:
        r = await c.post("/tokenize", json={"model": "fake-model", "prompt": "x" * 40,
                                            "return_token_strs": True})
    assert r.status_code == 200 and r.json()["token_strs"] == ["x"] * 40
    assert engine.calls == 1


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"1": 1, str(VOCAB): 1}}, "logit_bias"),
    ({"best_of": 129, "n": 1}, "best_of"),
    ({"stop_token_ids": list(range(1, 129))}, "stop_token_ids"),  # vLLM's GPU runner: 128
])
async def test_oversized_per_request_asks_are_refused_before_the_engine(extra, param):
    engine = FakeEngine()
    async with _client(engine) as c:
        r = await c.post("/v1/completions", json={**COMPLETION, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_logit_bias_may_cover_most_of_the_vocabulary():
    """LMQL masks the vocabulary through logit_bias: its bound is the vocabulary, not 1024."""
    async with _client(FakeEngine()) as c:
        r = await c.post("/v1/completions", json={
            **COMPLETION, "logit_bias": {str(i): -100 for i in range(40_000)}})
    assert r.status_code == 200, r.text


# --- memory ---------------------------------------------------------------------------------

def test_vllm_on_cpu_gets_a_fixed_kv_cache_unless_the_model_sizes_it(monkeypatch):
    """vLLM's CPU backend took half the machine's RAM for its KV cache by default."""
    from engines.vllm import args

    monkeypatch.setattr(args, "_has_cuda", lambda: False)
    assert args.engine_args({})["kv_cache_memory_bytes"] == args.CPU_KV_CACHE_BYTES == 2 * 1024**3
    assert args.engine_args({"kv_cache_memory_bytes": 1 << 30})["kv_cache_memory_bytes"] == 1 << 30
    assert "kv_cache_memory_bytes" not in args.engine_args({"gpu_memory_utilization": 0.3})
    monkeypatch.setattr(args, "_has_cuda", lambda: True)
    assert "kv_cache_memory_bytes" not in args.engine_args({})

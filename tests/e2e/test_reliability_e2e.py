"""Load, faults and auth through Ray Serve, on a third application of the session's Serve
instance: a tiny random Llama served by the pipeline engine with two replicas, small queue
limits and an API key (cheap to overload, to kill and to restart). The soak and the ingress
burst run against the session's vLLM gateway. Figures from longer runs of the same scenarios
(``bench/reliability.py``) are in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest
import websockets

from engines.kit.config import ModelConfig
from engines.kit.embedded import local_model_dir
from gateway.config import GatewayConfig
from gateway.ingress.keys import ApiKey
from gateway.model_routes import model_route
from tests.e2e.conftest import MODEL
from tests.e2e.serve_logs import replica_logs
from tests.pipeline_models import build_tiny
from tests.serve_session import _wait_healthy

APP, MODEL_APP, TINY, KEY = "faults", "faults-model", "tiny-llama", "reliability-key"
OTHER_KEY = "reliability-other-key"
AUTH = {"authorization": f"Bearer {KEY}"}
ONGOING, QUEUED, INGRESS_LIMIT = 4, 4, 48


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    tokenizer = Path(local_model_dir(f"embedded:{MODEL}") or "")
    return build_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama", tokenizer)


@pytest.fixture(scope="module")
def faults_url(gateway_url, tiny_source):
    from ray import serve

    from gateway.app import build_app, build_model_app

    source = tiny_source
    model = ModelConfig(name=TINY, engine="pipeline", source=str(source), num_replicas=2,
                        num_cpus=0.05, max_ongoing_requests=ONGOING, max_queued_requests=QUEUED,
                        engine_args={"num_stages": 1, "stage_num_cpus": 0.05,
                                     "max_sequences": ONGOING})
    settings = {"api_keys": [ApiKey(key=KEY), ApiKey(key=OTHER_KEY, name="other")],
                "max_concurrent_requests": INGRESS_LIMIT}
    # The default layout: the model its own application at /model/<name> (where HAProxy sends
    # requests naming it), the gateway application at /faults naming it; the tests below go
    # through the gateway's route unless they say otherwise.
    serve.run(build_model_app({"model": msgspec.to_builtins(model),
                               "gateway": msgspec.to_builtins(settings)}),
              name=MODEL_APP, route_prefix=model_route(TINY))
    config = GatewayConfig(models=[msgspec.structs.replace(model, app=MODEL_APP)],
                           ingress_num_cpus=0.05, **settings)
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    url = f"{gateway_url}/{APP}"
    _wait_healthy(url, "the faults gateway")
    yield url
    serve.delete(APP)
    serve.delete(MODEL_APP)


def _completion(max_tokens=24, stream=False) -> dict:
    return {"model": TINY, "prompt": "The capital of France is", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


# --- auth ---------------------------------------------------------------------------------

ROUTES = [  # method, path, body, how the protocol's 401 looks
    ("POST", "/v1/completions", _completion(2), lambda j: j["error"]["code"] == 401),
    ("POST", "/v1/chat/completions", {"model": TINY, "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "Hi"}]},
     lambda j: j["error"]["type"] == "AuthenticationError"),
    ("GET", "/v1/models", None, lambda j: j["error"]["code"] == 401),
    ("POST", "/tokenize", {"model": TINY, "prompt": "Hi"}, lambda j: j["error"]["code"] == 401),
    ("POST", "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
     lambda j: "error_type" in j),
    ("GET", "/info", None, lambda j: "error_type" in j),
    ("POST", "/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
     lambda j: j["code"] == 401),
    ("POST", f"/v2/models/{TINY}/generate", {"text_input": "Hi",
                                              "parameters": {"max_new_tokens": 2}},
     lambda j: "error_type" in j),
    ("GET", "/metrics", None, lambda j: j),
]


@pytest.mark.parametrize("method, path, body, shape", ROUTES, ids=[r[1] for r in ROUTES])
def test_auth_matrix(faults_url, method, path, body, shape):
    with httpx.Client(base_url=faults_url, timeout=60) as c:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": KEY},
                        {"authorization": f"Basic {KEY}"}):
            r = c.request(method, path, json=body, headers=headers)
            assert r.status_code == 401 and shape(r.json()), (headers, r.text)
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = c.request(method, path, json=body, headers={"authorization": f"{scheme} {KEY}"})
            assert r.status_code == 200, (scheme, r.text)
        for probe in ("/health", "/ping", "/v2/health/live", "/v2/health/ready"):
            assert c.get(probe).status_code == 200, probe


def test_a_stored_response_is_seen_by_its_own_key_only(faults_url):
    """Stored responses are per key (docs/protocols/responses.md): read through the model's
    replicas and the gateway's, another key gets the 404 of an unknown id."""
    from openai import NotFoundError, OpenAI

    owner, other = (OpenAI(base_url=f"{faults_url}/v1", api_key=key, max_retries=0, timeout=60)
                    for key in (KEY, OTHER_KEY))
    made = owner.responses.create(model=TINY, input="Hi", max_output_tokens=2)
    # Cut at 2 tokens a stream ends with response.incomplete (the SDK's stream helper wants
    # response.completed), stored all the same.
    streamed = [*owner.responses.create(model=TINY, input="Hi", max_output_tokens=2,
                                        stream=True)][-1].response
    for response_id in (made.id, streamed.id):
        for call in (other.responses.retrieve, other.responses.input_items.list,
                     other.responses.delete):
            with pytest.raises(NotFoundError):
                call(response_id)
        with pytest.raises(NotFoundError):
            other.responses.create(model=TINY, input="And?", max_output_tokens=2,
                                   previous_response_id=response_id)
        assert owner.responses.retrieve(response_id).id == response_id
    assert owner.responses.create(model=TINY, input="And?", max_output_tokens=2,
                                  previous_response_id=made.id).previous_response_id == made.id


async def test_lmtp_takes_the_key_in_the_url_lmql_can_carry(faults_url):
    ws_url = faults_url.replace("http", "ws", 1) + "/lmtp"
    frame = "GENERATE " + json.dumps({"model": TINY, "prompt": [1, 2], "stream_id": 1,
                                      "max_tokens": 3})
    for url, headers in ((ws_url, {}), (f"{ws_url}?api_key=nope", {})):
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url, additional_headers=headers):
                pass
        assert refused.value.response.status_code == 403
    for url, headers in ((f"{ws_url}?api_key={KEY}", {}), (ws_url, AUTH)):
        async with websockets.connect(url, additional_headers=headers) as ws:
            await ws.send(frame)
            items = []
            while not items or items[-1].get("finish_reason") is None:
                items += json.loads((await ws.recv()).partition(" ")[2])
            assert len(items) == 3


async def test_lmqls_own_client_connects_with_the_key_in_its_endpoint(faults_url, tiny_source):
    """LMQL's client sends no headers: the key travels in the endpoint it is given."""
    import lmql

    endpoint = faults_url.removeprefix("http://") + "/lmtp"
    query = 'argmax "Hello[A]" where len(TOKENS(A)) < 4'
    model = lmql.model(TINY, endpoint=f"{endpoint}?api_key={KEY}", tokenizer=str(tiny_source))
    result = await asyncio.wait_for(lmql.run(query, model=model), 120)
    assert result.variables["A"]
    refused = lmql.model(TINY, endpoint=f"{endpoint}?api_key=nope", tokenizer=str(tiny_source))
    with pytest.raises(Exception):  # noqa: B017 - LMQL wraps the refused upgrade its own way
        await asyncio.wait_for(lmql.run(query, model=refused), 60)


# --- overload -----------------------------------------------------------------------------

async def test_overload_is_refused_in_shape_and_the_admitted_requests_finish(faults_url):
    """Twice the ingress limit at once: what the ingress could not admit is refused with 503
    (by Serve's proxy, gateway.edge.proxy, when it is on the public port), the engine queue the few
    beyond it with 429 (OpenAI's shape, Retry-After on both), the rest stream to the end,
    nothing is a 5xx of another kind, and every engine request is released."""
    burst = 2 * INGRESS_LIMIT
    limits = httpx.Limits(max_connections=burst + 8)
    async with httpx.AsyncClient(base_url=faults_url, headers=AUTH, timeout=120,
                                 limits=limits) as c:
        async def one():
            async with c.stream("POST", "/v1/completions",
                                json=_completion(64, stream=True)) as r:
                return r.status_code, r.headers.get("retry-after"), await r.aread()

        async def probes():  # a saturated model is busy, not unhealthy: /health stays 200
            codes = []
            for _ in range(10):
                codes.append((await c.get("/health")).status_code)
                await asyncio.sleep(0.1)
            return codes

        *results, health = await asyncio.gather(*(one() for _ in range(burst)), probes())
        assert health == [200] * 10, health
        statuses = sorted(s for s, _, _ in results)
        assert set(statuses) <= {200, 429, 503}, statuses
        # A request the engine queue refuses frees its ingress slot at once for a later one,
        # so the split varies: the engine queue refuses some, and the replicas' worth run.
        # With Serve's proxy on the public port (LLM_GATEWAY_INGRESS=serve) its gate also
        # refuses what the ingress could not admit (503); HAProxy hands every request to the
        # ingress, whose 429s free its slots before 48 are taken.
        assert statuses.count(429) >= 1, statuses
        if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
            assert statuses.count(503) >= 1, statuses
        assert statuses.count(200) >= 2 * ONGOING, statuses
        print(f"\nburst of {burst}: {statuses.count(200)} x 200, {statuses.count(429)} x 429, "
              f"{statuses.count(503)} x 503")
        for status, retry_after, body in results:
            if status == 200:
                assert body.rstrip().endswith(b"data: [DONE]")
            else:
                assert retry_after == "1"
                error = json.loads(body)["error"]
                assert error["code"] == status and "retry later" in error["message"]
        assert (await c.get("/health")).status_code == 200
        await _until_idle(c)


async def test_anthropics_sdk_gets_its_529_when_the_engine_queue_is_full(faults_url):
    """The engine queue full, Anthropic's way: 529 ``overloaded_error`` (the SDK's
    OverloadedError, which it would retry) with Retry-After, never its 429 (that is the
    caller's own rate limit); the admitted messages finish."""
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=faults_url, api_key=KEY, max_retries=0,
                                      timeout=120)
    results = await asyncio.gather(*(client.messages.create(
        model=TINY, max_tokens=48, messages=[{"role": "user", "content": "Hi"}])
        for _ in range(4 * (ONGOING + QUEUED))), return_exceptions=True)
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and all(isinstance(r, anthropic.OverloadedError) for r in refused), refused
    for error in refused:
        assert error.status_code == 529 and error.response.headers["retry-after"] == "1"
        assert error.body["error"]["type"] == "overloaded_error"
    assert len(results) - len(refused) >= 2 * ONGOING
    async with httpx.AsyncClient(base_url=faults_url, headers=AUTH, timeout=60) as c:
        await _until_idle(c)


async def _until_idle(c: httpx.AsyncClient, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (await c.get("/gateway/engines")).json()[TINY]["active"]:
        assert time.monotonic() < deadline, "engine requests were not released"
        await asyncio.sleep(0.2)


# --- replica death ------------------------------------------------------------------------

def _replicas() -> list[tuple[str, str]]:
    import ray

    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{MODEL_APP}#engine-{TINY}#")]


def _kill(replica: tuple[str, str]) -> None:
    import ray

    ray.kill(ray.get_actor(*replica), no_restart=True)


async def _stream_until_end(c: httpx.AsyncClient, started: asyncio.Event, log: list):
    """One long OpenAI stream; records (status, time the stream ended, last data line)."""
    async with c.stream("POST", "/v1/completions", json=_completion(400, stream=True)) as r:
        last = b""
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                started.set()
                last = line.encode()
        log.append((r.status_code, time.monotonic(), last))


async def test_a_killed_replica_ends_its_streams_in_shape_and_costs_no_new_request(faults_url):
    async with httpx.AsyncClient(base_url=faults_url, headers=AUTH, timeout=120) as c:
        started, ended = asyncio.Event(), []
        streams = [asyncio.ensure_future(_stream_until_end(c, started, ended)) for _ in range(4)]
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.sleep(0.3)
        victim = _replicas()[0]
        killed_at = time.monotonic()
        _kill(victim)
        # New requests right after the kill: the survivor (or the retry) answers every one.
        # One at a time: the survivor's queue is small on purpose (overload is tested above).
        news = [await c.post("/v1/completions", json=_completion(4)) for _ in range(8)]
        assert [r.status_code for r in news] == [200] * 8, [r.text for r in news]
        await asyncio.wait_for(asyncio.gather(*streams), 120)
        failed = [(t, last) for status, t, last in ended if last != b"data: [DONE]"]
        for t, last in failed:  # the killed replica's streams: an error event, within a second
            assert t - killed_at < 1.5, t - killed_at
            assert json.loads(last.removeprefix(b"data: "))["error"]["message"]
        assert len(failed) < len(ended)  # the other replica's streams finished
        await _until_replicas(2)


async def _stream_or_cut(c: httpx.AsyncClient, started: asyncio.Event, log: list):
    """One long OpenAI stream; records (how it ended: done / error / cut, when)."""
    ended = "cut"
    try:
        async with c.stream("POST", "/v1/completions",
                            json=_completion(400, stream=True)) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    started.set()
                    ended = ("done" if line == "data: [DONE]" else
                             "error" if '"error"' in line else "cut")
    except httpx.TransportError:  # the response stopped before its last chunk
        ended = "cut"
    log.append((ended, time.monotonic()))


async def _until_routed_to_every_replica(c: httpx.AsyncClient, timeout_s: float = 60) -> None:
    """Until HAProxy sends requests to every running replica: it learns of a replacement some
    time after Serve reports it running (an earlier test killed one), and meanwhile every
    stream went to the other one. Which replica served a request: the one whose log has the
    request's id (on Serve's access line)."""
    running = {name.rsplit("#", 1)[1] for name, _ in _replicas()}
    served: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while served != running:
        assert time.monotonic() < deadline, (served, running)
        mine = f"route-{uuid.uuid4().hex[:12]}"
        r = await c.post("/v1/completions", json=_completion(2), headers={"x-request-id": mine})
        assert r.status_code == 200, r.text
        for _ in range(50):  # the line is written as the call ends, after the answer
            # The engine's replicas only: the model's ingress request router logs the request
            # too (docs/routing.md).
            logged = [replica for replica, text in replica_logs(MODEL_APP, "engine-").items()
                      if mine in text]
            if logged:
                served.update(logged)
                break
            await asyncio.sleep(0.1)


async def test_a_killed_replica_cuts_the_streams_it_served_itself(gateway_url, faults_url):
    """Requests naming the model at the public root go straight to the model's own
    application (HAProxy), whose replica is then also their HTTP server: when its process
    dies, their responses stop before their last chunk, which the client sees as an error at
    once (HAProxy cannot write into a response already started; never a hang, never a clean
    end), the other replica's streams finish, and new requests are served. docs/cluster.md,
    "The default layout"."""
    async with httpx.AsyncClient(base_url=gateway_url, headers=AUTH, timeout=120) as c:
        await _until_routed_to_every_replica(c)
        started, ended = asyncio.Event(), []
        streams = [asyncio.ensure_future(_stream_or_cut(c, started, ended)) for _ in range(4)]
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.sleep(0.3)
        killed_at = time.monotonic()
        _kill(_replicas()[0])
        news = [await c.post("/v1/completions", json=_completion(4)) for _ in range(8)]
        await asyncio.wait_for(asyncio.gather(*streams), 120)
    for r in news:  # HAProxy may try the dead replica first: then a 503 in shape
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == 503, r.text
    assert news[-1].status_code == 200, news[-1].text
    stopped = [(how, t) for how, t in ended if how != "done"]
    assert stopped and len(stopped) < len(ended), ended  # the other replica's streams finished
    for _, t in stopped:
        assert t - killed_at < 1.5, t - killed_at
    await _until_replicas(2)


async def test_with_no_replica_left_requests_get_a_fast_503_until_it_is_back(faults_url,
                                                                            tiny_source):
    """Both replicas killed while the model's storage is away (so the replacements cannot
    start until it is back): requests fail fast with 503 in every protocol's shape instead of
    waiting in Serve's router, and succeed again once a replica is up."""
    away = tiny_source.with_name(tiny_source.name + ".away")
    async with httpx.AsyncClient(base_url=faults_url, headers=AUTH, timeout=120) as c:
        assert (await c.post("/v1/completions", json=_completion(2))).status_code == 200
        tiny_source.rename(away)
        try:
            await _outage(c)
        finally:
            away.rename(tiny_source)
        restored_at = time.monotonic()
        recovered = None
        while recovered is None and time.monotonic() - restored_at < 300:
            if (await c.post("/v1/completions", json=_completion(2))).status_code == 200:
                recovered = time.monotonic() - restored_at
            else:
                await asyncio.sleep(0.5)
        assert recovered is not None, "the model did not come back"
        print(f"recovered {recovered:.1f} s after the model's storage was back")
        await _until_replicas(2)


async def _outage(c: httpx.AsyncClient) -> None:
    for replica in _replicas():
        _kill(replica)
    killed_at = time.monotonic()
    shapes = {  # protocol → (path, body, check of the 503 body)
        "openai": ("/v1/completions", _completion(2),
                   lambda j: j["error"]["type"] == "ServiceUnavailableError"),
        "tgi": ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                lambda j: j["error_type"] == "unavailable"),
        "lmi": ("/invocations", {"inputs": "Hi"}, lambda j: j["code"] == 503),
        "mindie": (f"/v2/models/{TINY}/generate", {"text_input": "Hi"},
                   lambda j: j["error_type"] == "Service Unavailable"),
    }
    answered = {}
    while time.monotonic() - killed_at < 120 and len(answered) < len(shapes):
        for name, (path, body, check) in shapes.items():
            sent = time.monotonic()
            r = await c.post(path, json=body)
            took = time.monotonic() - sent
            if r.status_code == 503 and name not in answered:
                assert check(r.json()) and r.headers["retry-after"] == "1", r.text
                # At worst: Serve's health-check period, the Serve-status monitor's interval,
                # then a probe's timeout, 2 s each (plus slack); not the restart (which waits
                # for the storage here).
                assert took < 10.0, (name, took)
                answered[name] = took
            else:
                assert r.status_code in (200, 503), (name, r.status_code, r.text)
        await asyncio.sleep(0.05)
    assert set(answered) == set(shapes), answered  # every protocol saw the outage in shape
    print(f"\nno replica: 503 after {answered} s")


async def _until_replicas(n: int, timeout_s: float = 300) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications[MODEL_APP].deployments[f"engine-{TINY}"]
        if status.replica_states.get("RUNNING", 0) >= n and status.status == "HEALTHY":
            return
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.5)


# --- soak and burst on the vLLM gateway -----------------------------------------------------

SOAK_PROMPTS = ["The capital of France is", "Water boils at a temperature of",
                "The largest planet in the solar system is", "Once upon a time, there was a",
                "def fibonacci(n):", "The chemical symbol for gold is"]
SOAK_TOKENS, SOAK_PREFIX = 12, 8  # characters that must match (bf16 batches may differ later)


async def _soak_call(c: httpx.AsyncClient, ws, protocol: str, prompt: str, ids: list[int]):
    """One greedy request on ``protocol``; the generated text."""
    if protocol == "openai":
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                  "max_tokens": SOAK_TOKENS, "temperature": 0})
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
    if protocol == "openai-stream":
        text = ""
        async with c.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": SOAK_TOKENS, "temperature": 0,
                "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return r.status_code, text
    if protocol == "tgi":
        r = await c.post("/generate", json={"inputs": prompt, "parameters": {
            "max_new_tokens": SOAK_TOKENS, "do_sample": False}})
        return r.status_code, r.json().get("generated_text", r.text)
    if protocol == "lmi":
        r = await c.post("/invocations", json={"inputs": prompt, "parameters": {
            "max_new_tokens": SOAK_TOKENS, "do_sample": False}})
        return r.status_code, r.json().get("generated_text", r.text)
    if protocol == "mindie":
        r = await c.post(f"/v2/models/{MODEL}/generate", json={"text_input": prompt, "parameters": {
            "max_new_tokens": SOAK_TOKENS, "do_sample": False}})
        return r.status_code, r.json().get("text_output", r.text)
    stream_id = f"{id(prompt)}-{time.monotonic_ns()}"
    await ws.send("GENERATE " + json.dumps({"model": MODEL, "prompt": ids, "stream_id": stream_id,
                                            "max_tokens": SOAK_TOKENS, "temperature": 0}))
    tokens: list[int] = []
    while True:  # one stream at a time per socket: every item is this stream's
        for item in json.loads((await ws.recv()).partition(" ")[2]):
            assert item["stream_id"] == stream_id, item
            if "error" in item:
                return 500, item["error"]
            tokens.append(item["token"])
            if item.get("finish_reason"):
                r = await c.post("/detokenize", json={"model": MODEL, "tokens": tokens})
                return 200, r.json()["prompt"]


async def test_soak_mixed_protocols_loses_and_crosses_nothing(gateway_url, engine_handle):
    """16 concurrent clients, each sending one request on each of six protocol paths (in a
    rotated order, over six prompts): every answer is its own prompt's greedy continuation
    (vLLM's own output is the oracle), none is lost, none hangs, and every engine request is
    released afterwards. (bench/reliability.py runs 48 clients for 4 minutes.)"""
    refs = {p: await engine_handle.reference_greedy.remote(p, SOAK_TOKENS) for p in SOAK_PROMPTS}
    heads = {p: r.text[:SOAK_PREFIX] for p, r in refs.items()}
    assert len(set(heads.values())) == len(heads)  # a crossed answer cannot pass for its own
    protocols = ["openai", "openai-stream", "tgi", "lmi", "mindie", "lmtp"]
    outcome = {"ok": 0, "crossed": [], "failed": []}

    async def client(k: int):
        async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as c, \
                websockets.connect(gateway_url.replace("http", "ws", 1) + "/lmtp") as ws:
            for j in range(len(protocols)):
                prompt, protocol = SOAK_PROMPTS[(k + j) % 6], protocols[(2 * k + j) % 6]
                status, text = await asyncio.wait_for(
                    _soak_call(c, ws, protocol, prompt, refs[prompt].prompt_token_ids), 60)
                if status != 200:
                    outcome["failed"].append((protocol, status, text))
                elif not text.startswith(heads[prompt]):
                    outcome["crossed"].append((protocol, prompt, text))
                else:
                    outcome["ok"] += 1

    await asyncio.gather(*(client(k) for k in range(16)))
    print(f"\nsoak: {outcome['ok']} ok, {len(outcome['crossed'])} crossed, "
          f"{len(outcome['failed'])} failed")
    assert not outcome["failed"] and not outcome["crossed"], outcome
    assert outcome["ok"] == 16 * len(protocols)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as c:
        until = time.monotonic() + 10
        while (await c.get("/gateway/engines")).json()[MODEL]["active"]:
            assert time.monotonic() < until, "engine requests were not released"
            await asyncio.sleep(0.1)


def _traces(request_ids: list[str], engines: httpx.Response) -> str:
    """What the replicas logged of requests that got no answer (none: never reached one), and
    what the engines hold now: where a request was lost."""
    seen = {i: [line.strip()[:200] for text in replica_logs("").values()
                for line in text.splitlines() if f" {i} " in line] for i in request_ids}
    return f"no answer to {len(request_ids)}: {seen}; engines now: {engines.text[:500]}"


async def _burst(url: str, burst: str, count: int) -> list:
    """``count`` concurrent completions, each with its own id; (status, type) or the error."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=1000)
    async with aiohttp.ClientSession(url, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def one(i: int):
            # Each request's id is the client's (HAProxy and the replicas log it): a request
            # that gets no answer can be looked up in the replicas' logs.
            async with session.post("/v1/completions", headers={"x-request-id": f"{burst}-{i}"},
                                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}) as r:
                await r.read()
                return r.status, r.headers.get("content-type", "")

        return await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)


async def test_a_burst_of_non_streaming_requests_gets_no_bare_500(gateway_url):
    """The finding: 2,000 concurrent completions drowned the ingress (Serve stopped it after
    missed health checks; 1,024 plain-text 500s). Now the excess is refused in shape at the
    door and the ingress stays healthy. (900 here; bench/reliability.py runs 2,000.)

    The burst runs on an event loop of its own: on the test session's loop, late in a full run,
    1-4 of the 900 timed out after 300 s while the replica had logged their 200s and HAProxy
    held no session: each answer sat unread in the client's socket (CLOSE-WAIT), with httpx
    and with aiohttp alike, and always requests 10-13, the burst's first new sockets (likely
    descriptors the session's loop still counted as its own after an earlier test closed
    them)."""
    burst = f"burst-{time.monotonic_ns()}"
    answers = await asyncio.to_thread(asyncio.run, _burst(gateway_url, burst, 900))
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as c:
        unanswered = [f"{burst}-{i}" for i, a in enumerate(answers)
                      if isinstance(a, BaseException)]
        assert not unanswered, _traces(unanswered, await c.get("/gateway/engines"))
        results = [a for a in answers if not isinstance(a, BaseException)]
        statuses = [s for s, _ in results]
        print("\nburst of 900: " + ", ".join(f"{statuses.count(s)} x {s}"
                                               for s in sorted(set(statuses))))
        assert set(statuses) <= {200, 429, 503}, statuses
        assert all(t.startswith("application/json") for _, t in results)
        assert statuses.count(200) >= 256
        assert (await c.get("/health")).status_code == 200


# --- ingress death ------------------------------------------------------------------------

async def _engine_idle(c: httpx.AsyncClient, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (await c.get("/gateway/engines")).json()[MODEL]["active"]:
        assert time.monotonic() < deadline, "engine requests were not released"
        await asyncio.sleep(0.2)


async def _timed(c: httpx.AsyncClient, path: str, body: dict,
                 after_s: float) -> tuple[httpx.Response, float]:
    """A short request sent after ``after_s``; its response and when it arrived (monotonic)."""
    await asyncio.sleep(after_s)
    short = {**body, "max_tokens": 2} if "prompt" in body else {
        **body, "parameters": {"max_new_tokens": 2}}
    r = await c.post(path, json=short)
    return r, time.monotonic()


async def _served_again(c: httpx.AsyncClient, path: str, body: dict) -> float:
    """When a short request is first served again (monotonic): the replacement is up."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        r, arrived = await _timed(c, path, body, 0.1)
        if r.status_code == 200:
            return arrived
    raise AssertionError("nothing was served within 300 s of the ingress's death")


async def test_a_killed_ingress_replica_answers_in_flight_requests_in_shape(gateway_url):
    """The gateway application's ingress replica dies with requests in flight on four
    protocols: Serve's proxy has no answer for them (before gateway.edge.proxy, uvicorn's plain-text
    500); each client gets a 503 in its own protocol's shape, the engine requests are
    released, and the gateway serves again once Serve replaced the replica. The OpenAI and
    MindIE requests name the model by its alias, so that they take the gateway's route;
    requests naming the model go to its own application and are served throughout (before
    gateway.edge.ingress_watch knew models' applications, its gate in their replicas refused them).
    Last in the module: it restarts the ingress."""
    import ray

    long = {"max_new_tokens": 400, "ignore_eos": True}  # ~20 s of vLLM decoding here
    requests = {  # protocol → (path, body, check of the 503 body)
        "openai": ("/v1/completions", {"model": "ensemble", "prompt": "Hi", "max_tokens": 400,
                                       "ignore_eos": True},
                   lambda j: j["error"]["code"] == 503 and "retry" in j["error"]["message"]),
        "tgi": ("/generate", {"inputs": "Hi", "parameters": long},
                lambda j: j["error_type"] == "generation" and "retry" in j["error"]),
        "lmi": ("/invocations", {"inputs": "Hi", "parameters": long},
                lambda j: j["code"] == 503),
        "mindie": ("/v2/models/ensemble/generate", {"text_input": "Hi", "parameters": long},
                   lambda j: "retry" in j["error"]),
    }
    (ingress,) = [(a["name"], a["namespace"])
                  for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::gateway#GatewayIngress#")]
    async with httpx.AsyncClient(base_url=gateway_url, timeout=120) as c:
        await _engine_idle(c)
        aborted = (await c.get("/gateway/engines")).json()[MODEL]["aborted"]
        calls = {name: asyncio.ensure_future(c.post(path, json=body))
                 for name, (path, body, _) in requests.items()}
        deadline = time.monotonic() + 30
        while (await c.get("/gateway/engines")).json()[MODEL]["active"] < len(requests):
            done = {n: f.result().text for n, f in calls.items() if f.done()}
            assert not done and time.monotonic() < deadline, ("not all in the engine", done)
            await asyncio.sleep(0.1)
        _kill(ingress)
        during = [asyncio.ensure_future(_timed(c, *list(requests.values())[i % 4][:2], i / 20))
                  for i in range(20)]
        up = asyncio.ensure_future(_served_again(c, *requests["openai"][:2]))
        named = [await _timed(c, "/v1/completions", {"model": MODEL, "prompt": "Hi"}, 0)
                 for _ in range(3)]
        answers = dict(zip(calls, await asyncio.wait_for(asyncio.gather(*calls.values()), 60),
                           strict=True))
        during = await asyncio.gather(*during)
        up_at = await up
    # Requests sent while no ingress replica is there: refused in shape at once (the proxy's
    # gate), never held until the replacement starts (6-9 s before; 1 s measured,
    # docs/reliability.md): every refusal arrived before anything was served again. A
    # replacement already up may serve the last ones.
    for r, arrived in during:
        assert r.status_code in (200, 503), (r.status_code, r.text)
        if r.status_code == 503:
            assert arrived < up_at, ("held until the replacement was up", up_at - arrived)
            assert r.headers["retry-after"] == "1" and r.headers["content-type"].startswith(
                "application/json"), r.text
    assert any(r.status_code == 503 for r, _ in during)
    for r, arrived in named:  # while the gateway's ingress was down
        assert r.status_code == 200 and arrived < up_at, (r.text, arrived - up_at)
    for name, r in answers.items():
        assert r.status_code == 503, (name, r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/json"), (name, r.text)
        assert requests[name][2](r.json()) and r.headers["retry-after"] == "1", (name, r.text)
    _wait_healthy(gateway_url, "the gateway after its ingress was replaced")
    async with httpx.AsyncClient(base_url=gateway_url, timeout=120) as c:
        # The dead ingress's engine requests were aborted (engines.replica.callers), not decoded to
        # their end: 400 tokens take longer than this wait on a 2-core AVX2 box.
        await _engine_idle(c)
        assert (await c.get("/gateway/engines")).json()[MODEL]["aborted"] >= aborted + len(
            requests)
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text

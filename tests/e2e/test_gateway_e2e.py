"""Pluggable engines and protocols, end to end against real vLLM behind Ray Serve: the engine
kind reported where protocols name the backend, one admission refusing the same request on every
protocol in that protocol's shape, and a gateway that mounts only some protocols."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import websockets

from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.engine_client import ServeEngineClient
from gateway.ingress.registry import ModelRegistry
from tests.e2e.conftest import MODEL
from tests.seed_examples import LMI_SEED_ERROR
from tests.serve_session import serve_in_thread

PROMPT = "The capital of France is"


def test_the_engine_kind_is_what_protocols_report(http):
    assert http.get(f"/v2/models/{MODEL}").json()["platform"] == "vllm"
    r = http.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.headers["x-compute-type"] == "vllm"
    assert set(http.get("/gateway/engines").json()[MODEL]) == {"active", "aborted", "started"}
    assert list(http.get("/").json()["protocols"]) == ["openai", "lmtp", "mindie", "lmi", "tgi",
                                                       "aici", "anthropic", "responses"]


async def test_one_admission_refuses_too_many_logprobs_on_every_protocol(http, gateway_url):
    """vLLM's max_logprobs (20) is checked once, in the engine replica; each protocol renders
    the same refusal in its own shape."""
    message = "logprobs must be in [0, 20]"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                           "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["message"] == message
    assert r.json()["error"]["param"] == "logprobs"
    r = http.post("/invocations", json={"inputs": PROMPT, "parameters": {"top_n_tokens": 21}})
    assert r.status_code == 400 and r.json() == {**LMI_SEED_ERROR, "error": message, "code": 400}

    async def lmtp() -> dict:
        ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        async with websockets.connect(gateway_url.replace("http", "ws", 1) + "/lmtp") as ws:
            await ws.send("GENERATE " + json.dumps({"model": MODEL, "prompt": ids,
                                                    "stream_id": 1, "top_logprobs": 21}))
            kind, _, body = (await ws.recv()).partition(" ")
            assert kind == "TOKEN"
            return json.loads(body)[0]

    assert await lmtp() == {"stream_id": 1, "error": message}


@pytest.fixture(scope="module")
def subset_url(engine_handle) -> Iterator[str]:
    """A gateway mounting only MindIE and OpenAI, over the session's engine."""
    registry = ModelRegistry({MODEL: ServeEngineClient(engine_handle)})
    config = GatewayConfig(protocols=["mindie", "openai"])
    with serve_in_thread(create_app(registry, config)) as url:
        yield url


def test_a_gateway_serves_only_the_protocols_it_enables(subset_url):
    with httpx.Client(base_url=subset_url, timeout=120) as client:
        r = client.post(f"/v2/models/{MODEL}/generate",
                        json={"text_input": PROMPT, "parameters": {"max_new_tokens": 3}})
        assert r.status_code == 200 and r.json()["text_output"]
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        # TGI and LMI are off: their paths are nobody's, answered in MindIE's (first) shape
        for path in ("/generate", "/invocations"):
            r = client.post(path, json={"inputs": PROMPT})
            assert r.status_code == 404
            assert r.json() == {"error": "Not Found", "error_type": "NotFoundError"}
        assert client.get("/ping").status_code == 404  # SageMaker's probe belongs to LMI
        assert list(client.get("/").json()["protocols"]) == ["mindie", "openai"]

"""Observability end to end (docs/observability.md): a real Prometheus, with the scrape
configuration the project ships, scrapes Ray's metrics agents while a known mix of requests goes
through every protocol of a gateway application with two ingress replicas; the shipped Grafana
dashboard's every expression is run against it; request ids round-trip and reach the engine
replica's log.

Oracles: the mix itself (what was sent, how many streamed, which were refused) and vLLM's own
counts for the tokens (its scheduler's per-step figures, ``ray_llm_gateway_vllm_*``, not the
usage the gateway reads from each generation's end).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import httpx
import pytest
import websockets

from engines.kit.config import Controllers, ModelConfig
from gateway.config import GatewayConfig
from tests.aici_client import AiciClient
from tests.e2e.notebooks import run_notebook
from tests.e2e.prometheus import running_prometheus
from tests.e2e.serve_logs import replica_logs
from tests.serve_session import (
    MAX_REQUEST_BYTES,
    MODEL,
    MODEL_APP,
    PIPELINE_MODEL,
    _wait_healthy,
)

pytestmark = pytest.mark.e2e

METERED_APP = "metered"
TOKENS = 5  # every generation of the mix runs to this length
TEXT = "Once upon a time, in a small village by the sea, there lived"
CHAT = [{"role": "user", "content": "Write a long story about a dragon and a lighthouse."}]
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "llm-gateway.json"
FINISHED = ("eos", "stop_sequence", "length")


@pytest.fixture(scope="module")
def metered_url(gateway_url):
    """The session's model behind a gateway application of two ingress replicas (requests
    reach the model's replica through its handle, as for any model in an application of its
    own)."""
    from ray import serve

    from gateway.app import build_app

    model = ModelConfig(name=MODEL, app=MODEL_APP, controllers=Controllers(
        custom={"redact": "engines.controllers.api.examples:Redact"}))
    config = GatewayConfig(models=[model], ingress_replicas=2, ingress_num_cpus=0.05,
                           max_request_bytes=MAX_REQUEST_BYTES)
    # Logs as one JSON object per line, as docs/observability.md tells operators to ask for.
    serve.run(build_app(config), name=METERED_APP, route_prefix=f"/{METERED_APP}",
              logging_config={"encoding": "JSON"})
    url = f"{gateway_url}/{METERED_APP}"
    _wait_healthy(url, "the metered gateway")
    # Kept to the session's end, as the other applications are: deleting it reloads HAProxy.
    # (A next module's request got a 408 in CI then; the same 408s came later without a
    # reload: HAProxy's 2 s wait for a body, since made 60 s, gateway/edge/haproxy_models.py.)
    return url


@pytest.fixture(scope="module")
def prometheus(metered_url, tmp_path_factory):
    with running_prometheus(tmp_path_factory.mktemp("prometheus")) as server:
        yield server


SERIES = {  # expression → the labels its values are keyed by
    f'sum by (protocol, outcome) (ray_llm_gateway_requests_total{{model="{MODEL}"}})':
        ("protocol", "outcome"),
    f'sum by (protocol) (ray_llm_gateway_time_to_first_token_seconds_count{{model="{MODEL}"}})':
        ("protocol",),
    f'sum by (protocol) (ray_llm_gateway_inter_token_latency_seconds_count{{model="{MODEL}"}})':
        ("protocol",),
    'sum by (protocol, reason) (ray_llm_gateway_refusals_total)': ("protocol", "reason"),
    f'sum(ray_llm_gateway_generation_tokens_total{{model="{MODEL}"}})': (),
    f'sum(ray_llm_gateway_prompt_tokens_total{{model="{MODEL}"}})': (),
    f'sum(ray_llm_gateway_vllm_generation_tokens_total{{model="{MODEL}"}})': (),
    f'sum(ray_llm_gateway_vllm_prompt_tokens_total{{model="{MODEL}"}})': (),
    f'sum(ray_llm_gateway_vllm_requests_finished_total{{model="{MODEL}"}})': (),
    f'sum by (transport) (ray_llm_gateway_engine_streams_total{{model="{MODEL}"}})':
        ("transport",),
}
(REQUESTS, TTFT, ITL, REFUSALS, TOKENS_OUT, TOKENS_IN, VLLM_OUT, VLLM_IN, VLLM_DONE,
 STREAMS) = SERIES


def _delta(after: dict, before: dict) -> dict:
    changed = {key: value - before.get(key, 0.0) for key, value in after.items()}
    return {key: value for key, value in changed.items() if value}


def _send_the_mix(url: str) -> None:
    """14 generations of TOKENS tokens each (7 streamed) over all eight protocols, one that
    the engine refuses, and three that the protocols refuse."""
    with httpx.Client(base_url=url, timeout=120) as http:
        def ok(response: httpx.Response) -> httpx.Response:
            assert response.status_code == 200, response.text
            return response

        completion = {"model": MODEL, "prompt": TEXT, "max_tokens": TOKENS, "temperature": 0}
        for stream in (False, False, True, True):
            ok(http.post("/v1/completions", json={**completion, "stream": stream}))
        ok(http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT,
                                                    "max_tokens": TOKENS, "stream": True}))
        message = {"model": MODEL, "messages": CHAT, "max_tokens": TOKENS}
        for stream in (False, True):
            ok(http.post("/v1/messages", json={**message, "stream": stream},
                         headers={"anthropic-version": "2023-06-01"}))
        ok(http.post("/v1/responses", json={"model": MODEL, "input": CHAT[0]["content"],
                                            "max_output_tokens": TOKENS}))
        tgi = {"inputs": TEXT, "parameters": {"max_new_tokens": TOKENS}}
        ok(http.post("/generate", json=tgi))
        ok(http.post("/generate_stream", json=tgi))
        ok(http.post("/invocations", json=tgi))
        ok(http.post(f"/v2/models/{MODEL}/generate",
                     json={"text_input": TEXT, "parameters": {"max_new_tokens": TOKENS}}))
        ids = ok(http.post("/tokenize", json={"prompt": TEXT})).json()["tokens"]
        # Refused: by the engine (a token outside the vocabulary), by the protocols.
        assert http.post("/v1/completions", json={**completion, "prompt": [10**7]}
                         ).status_code == 400
        for _ in range(2):
            assert http.post("/v1/completions", json={**completion, "model": "nope"}
                             ).status_code == 404
        assert http.post("/generate", json={"inputs": TEXT, "parameters": {
            "temperature": -1}}).status_code == 422
    asyncio.run(_lmtp_generation(url, ids))
    result = AiciClient(f"{url}/v1/").run(controller="none", controller_arg=TEXT,
                                          max_tokens=TOKENS)
    assert result["error"] is None


async def _lmtp_generation(url: str, prompt_ids: list[int]) -> None:
    async with websockets.connect(url.replace("http://", "ws://") + "/") as ws:
        await ws.send("GENERATE " + json.dumps({"model": MODEL, "prompt": prompt_ids,
                                                 "stream_id": 1, "max_tokens": TOKENS}))
        async with asyncio.timeout(120):
            while True:
                items = json.loads((await ws.recv()).partition(" ")[2])
                if any(item.get("finish_reason") or item.get("error") for item in items):
                    return


def test_counters_equal_what_was_sent_across_two_ingress_replicas(metered_url, prometheus):
    before = prometheus.settled(SERIES)
    _send_the_mix(metered_url)
    after = prometheus.settled(SERIES)
    delta = {name: _delta(after[name], before[name]) for name in SERIES}
    assert delta[REQUESTS] == {
        ("openai", "length"): 5, ("anthropic", "length"): 2, ("responses", "length"): 1,
        ("tgi", "length"): 2, ("lmi", "length"): 1, ("mindie", "length"): 1,
        ("lmtp", "length"): 1, ("aici", "length"): 1, ("openai", "validation"): 1}
    # Streamed: 2 completions and a chat, Anthropic's stream, TGI's, LMTP's socket, AICI's run.
    assert delta[TTFT] == {("openai",): 3, ("anthropic",): 1, ("tgi",): 1, ("lmtp",): 1,
                           ("aici",): 1}
    # A gap between each two tokens of those streams (the histogram counted in the replicas).
    assert delta[ITL] == {key: streams * (TOKENS - 1) for key, streams in delta[TTFT].items()}
    assert delta[REFUSALS] == {("openai", "validation"): 1, ("openai", "not_found"): 2,
                               ("tgi", "validation"): 1}
    # Tokens: what vLLM itself counted, and 14 finished generations of TOKENS each.
    assert delta[TOKENS_OUT] == delta[VLLM_OUT] == {(): 14 * TOKENS}
    assert delta[TOKENS_IN] == delta[VLLM_IN] and delta[TOKENS_IN][()] > 0
    assert delta[VLLM_DONE] == {(): 14}
    # Every generation reached the engine over the engine channel: a broken channel falls
    # back to Ray's streamed results and would pass every other assertion. 15: the 14, and the
    # one the engine refused.
    assert delta[STREAMS] == {("channel",): 15}
    # Both ingress replicas served part of the mix: the sums above add up over replicas.
    served = prometheus.values(f'sum by (replica) (ray_serve_deployment_request_counter_total'
                               f'{{application="{METERED_APP}"}})', "replica")
    assert len(served) == 2, served


def _dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"].replace("$model", ".*")
             .replace("$__rate_interval", "10m"))
            for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_dashboard_panel_has_data(metered_url, prometheus, pipeline_url):
    _send_the_mix(metered_url)  # every protocol, refusals, a websocket: this test's own load
    # The engine kinds' own panels: one pipeline generation, one run of a grammar controller.
    response = httpx.post(f"{pipeline_url}/v1/completions", timeout=120, json={
        "model": PIPELINE_MODEL, "prompt": TEXT, "max_tokens": 3})
    assert response.status_code == 200, response.text
    grammar = {"grammar": {"grammars": [{"lark_grammar": r"start: /Answer: [0-9]{2}\./"}]}}
    assert AiciClient(f"{metered_url}/v1/").run(controller="llguidance", controller_arg=grammar,
                                                max_tokens=20)["error"] is None
    queries = _dashboard_queries()
    assert len(queries) >= 16
    deadline = time.monotonic() + 120
    while True:
        empty = [(title, expr) for title, expr in queries if not prometheus.query(expr)]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not empty, (empty, prometheus.targets())


def test_the_metrics_notebook_plots_ttft_and_itl_per_protocol(metered_url, prometheus,
                                                              monkeypatch):
    for name, value in (("GATEWAY_URL", metered_url), ("PROMETHEUS_URL", prometheus.url),
                        ("NOTEBOOK_REQUESTS", "2"), ("NOTEBOOK_TOKENS", "8")):
        monkeypatch.setenv(name, value)  # the kernel inherits this environment
    outputs, text = run_notebook("metrics.ipynb")
    rows = text[text.index("TTFT p50"):].splitlines()[1:6]
    assert [row.split()[0] for row in rows] == ["openai", "anthropic", "responses", "tgi",
                                                "mindie"]
    for row in rows:  # every stream counted; each percentile a number of seconds
        streams, *seconds = row.split()[1:]
        assert float(streams) >= 2 and all(0 < float(s) < 600 for s in seconds), row
    assert any("image/png" in o.get("data", {}) for o in outputs)


@pytest.mark.parametrize("layout", ["default", "metered"])
def test_request_ids_round_trip_on_every_http_protocol(layout, gateway_url, metered_url):
    url = gateway_url if layout == "default" else metered_url
    tgi = {"inputs": TEXT, "parameters": {"max_new_tokens": 2}}
    calls = {"openai": ("/v1/completions", {"model": MODEL, "prompt": TEXT, "max_tokens": 2}),
             "anthropic": ("/v1/messages", {"model": MODEL, "messages": CHAT, "max_tokens": 2}),
             "responses": ("/v1/responses", {"model": MODEL, "input": TEXT,
                                             "max_output_tokens": 16}),
             "tgi": ("/generate", tgi), "lmi": ("/invocations", tgi),
             "mindie": (f"/v2/models/{MODEL}/generate", {"text_input": TEXT}),
             "aici": ("/v1/run", {"controller": "none", "controller_arg": TEXT,
                                  "max_tokens": 2}),
             "refused": ("/v1/completions", {"model": "nope", "prompt": TEXT})}
    with httpx.Client(base_url=url, timeout=120) as http:
        for name, (path, body) in calls.items():
            mine = f"client-{name}-{uuid.uuid4().hex[:8]}"
            response = http.post(path, json=body, headers={"x-request-id": mine})
            assert response.status_code in (200, 404), (name, response.text)
            assert response.headers.get_list("x-request-id") == [mine], name
            theirs = http.post(path, json=body).headers.get_list("x-request-id")
            assert len(theirs) == 1 and theirs[0] and theirs[0] != mine, (name, theirs)


def test_the_request_id_is_in_the_engine_replicas_log(metered_url):
    """Through an ingress replica to the model's replica over its handle: the engine replica's
    log lines for the request carry the client's id, and so do the ingress replica's, which
    its application's logging config makes JSON objects."""
    mine = f"client-log-{uuid.uuid4().hex[:8]}"
    response = httpx.post(f"{metered_url}/generate", timeout=120, headers={"x-request-id": mine},
                          json={"inputs": TEXT, "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            mine in "".join(replica_logs(app).values()) for app in (MODEL_APP, METERED_APP)):
        time.sleep(1)  # Serve's log handlers write in the background
    lines = [line for text in replica_logs(MODEL_APP).values() for line in text.splitlines()
             if mine in line]
    # Serve's line for the engine call (the ingress replica reached it through its handle).
    assert any("generate" in line for line in lines), (mine, lines)
    # The ingress replicas log JSON (their application's logging config): the request's lines
    # are objects naming it.
    ingress = [json.loads(line) for text in replica_logs(METERED_APP).values()
               for line in text.splitlines() if mine in line]
    assert ingress and all(entry["request_id"] == mine for entry in ingress), ingress

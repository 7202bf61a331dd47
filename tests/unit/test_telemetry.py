"""The request series and request ids (gateway/ingress/telemetry.py) over the fake engine, with a
recording stand-in for ``ray.util.metrics`` (the real one: tests/e2e/test_observability_e2e.py,
through a real Prometheus)."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

import httpx
import pytest
from starlette.testclient import TestClient

from contract import (
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    Sampling,
    TextPrompt,
    TokenEvent,
    Usage,
)
from engines.kit.config import ModelConfig
from engines.kit.telemetry import CountedHistogram, EngineMetrics
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.keys import ApiKey
from gateway.ingress.registry import ModelRegistry
from gateway.ingress.telemetry import InstrumentedEngine
from tests.fake_engine import FakeEngine
from tests.recorded_metrics import Recorded


def _app(recorded: Recorded, engine: FakeEngine | None = None, **config):
    settings = GatewayConfig(models=[ModelConfig(name="fake-model")], **config)
    return create_app(ModelRegistry({"fake-model": engine or FakeEngine()}), settings,
                      metrics=recorded.metrics())


@pytest.fixture
async def http(recorded):
    transport = httpx.ASGITransport(app=_app(recorded))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield client


OPENAI = {"protocol": "openai", "model": "fake-model", "engine": "vllm"}  # as configured


async def test_a_whole_completion_counts_its_outcome_tokens_and_latency(http, recorded):
    response = await http.post("/v1/completions", json={"model": "fake-model", "prompt": "Hi",
                                                        "max_tokens": 4})
    usage = response.json()["usage"]
    assert recorded.counts["llm_gateway_requests"] == {
        tuple(sorted({**OPENAI, "outcome": "length"}.items())): 1}
    assert recorded.count("llm_gateway_prompt_tokens", **OPENAI) == usage["prompt_tokens"]
    assert recorded.count("llm_gateway_generation_tokens", **OPENAI) == 4
    assert len(recorded.observations("llm_gateway_request_latency_seconds", **OPENAI)) == 1
    # Not streamed: the client saw no first token before the whole answer.
    assert not recorded.observed["llm_gateway_time_to_first_token_seconds"]
    recorded.keeper.refresh()
    assert not recorded.levels["llm_gateway_inter_token_latency_seconds_count"]
    assert recorded.levels["llm_gateway_requests_in_flight"] == {
        tuple(sorted(OPENAI.items())): 0}


async def test_a_stream_has_one_first_token_and_a_gap_per_further_token(http, recorded):
    async with http.stream("POST", "/v1/completions", json={
            "model": "fake-model", "prompt": "Hi", "max_tokens": 5, "stream": True}) as response:
        assert response.status_code == 200
        await response.aread()
    assert len(recorded.observations("llm_gateway_time_to_first_token_seconds", **OPENAI)) == 1
    recorded.keeper.refresh()  # the gaps are counted in the process, handed to Ray from here
    assert recorded.level("llm_gateway_inter_token_latency_seconds_count", **OPENAI) == 4
    assert recorded.level("llm_gateway_inter_token_latency_seconds_sum", **OPENAI) >= 0
    assert recorded.count("llm_gateway_requests", outcome="length") == 1


async def test_refusals_are_counted_by_reason_in_each_protocols_name(http, recorded):
    assert (await http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            ).status_code == 404
    # The engine refuses this one (a prompt beyond the fake's 64-token context).
    assert (await http.post("/v1/completions", json={"model": "fake-model", "prompt": "x" * 200})
            ).status_code == 400
    assert (await http.post("/generate", json={"inputs": "x", "parameters": {
        "temperature": -1}})).status_code == 422
    refusals = recorded.counts["llm_gateway_refusals"]
    assert refusals == {
        (("protocol", "openai"), ("reason", "not_found"), ("status", "404")): 1,
        (("protocol", "openai"), ("reason", "validation"), ("status", "400")): 1,
        (("protocol", "tgi"), ("reason", "validation"), ("status", "422")): 1}
    assert recorded.count("llm_gateway_requests", outcome="validation") == 1


class _Failing(FakeEngine):
    """Refuses every generation with the engine's own error."""

    async def generate(self, request):
        yield ErrorEvent(kind="engine", message="the engine failed")


async def test_an_engine_failure_is_counted_under_the_engines_own_kind(recorded):
    transport = httpx.ASGITransport(app=_app(recorded, engine=_Failing()))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        response = await client.post("/v1/completions", json={"model": "fake-model",
                                                               "prompt": "Hi"})
    assert response.status_code >= 500
    assert recorded.counts["llm_gateway_refusals"] == {
        (("protocol", "openai"), ("reason", "engine"), ("status", str(response.status_code))): 1}
    assert recorded.count("llm_gateway_requests", outcome="engine") == 1


async def test_refusals_at_the_door_name_their_reason(recorded):
    transport = httpx.ASGITransport(app=_app(recorded, api_key="k"))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        assert (await http.post("/v1/completions", json={})).status_code == 401
        assert (await http.post("/v1/completions", content=b"x" * (65 << 20),
                                headers={"authorization": "Bearer k"})).status_code == 413
    assert recorded.count("llm_gateway_refusals", reason="unauthorized", status="401") == 1
    assert recorded.count("llm_gateway_refusals", reason="too_large", status="413") == 1


async def test_a_keys_rate_limit_and_the_gateways_capacity_are_their_own_reasons(recorded):
    keys = [ApiKey(key="slow", requests_per_s=1, tokens_per_min=1)]
    transport = httpx.ASGITransport(app=_app(recorded, api_keys=keys))
    body = {"model": "fake-model", "prompt": "Hi", "max_tokens": 4}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                 headers={"authorization": "Bearer slow"}) as http:
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        assert (await http.post("/v1/completions", json=body)).status_code == 429
    assert recorded.count("llm_gateway_refusals", reason="rate_limit", status="429") == 1
    slow = FakeEngine(delay=0.05)
    transport = httpx.ASGITransport(app=_app(recorded, slow, max_concurrent_requests=1))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body)
                                         for _ in range(2)))
    assert sorted(a.status_code for a in answers) == [200, 503]
    assert recorded.count("llm_gateway_refusals", reason="admission", status="503") == 1


async def test_request_ids_are_the_clients_or_new_and_one_per_response(http):
    mine = await http.post("/v1/completions", headers={"x-request-id": "abc-123"},
                           json={"model": "fake-model", "prompt": "Hi", "max_tokens": 1})
    assert mine.headers.get_list("x-request-id") == ["abc-123"]
    new = [(await http.get("/health")).headers.get_list("x-request-id") for _ in range(2)]
    assert all(len(ids) == 1 and len(ids[0]) == 32 for ids in new) and new[0] != new[1]
    # Not kept: what could not go into a header or a log line as it is.
    odd = await http.get("/health", headers={"x-request-id": "two words " + "x" * 200})
    assert odd.headers["x-request-id"] != "two words " + "x" * 200
    refused = await http.post("/v1/completions", headers={"x-request-id": "abc-404"},
                              json={"model": "nope", "prompt": "x"})
    assert refused.headers.get_list("x-request-id") == ["abc-404"]


def test_an_lmtp_socket_is_open_while_connected_and_its_streams_are_streamed(recorded):
    with TestClient(_app(recorded, engine=FakeEngine(reply="abc"))) as client:
        with client.websocket_connect("/") as ws:
            ws.send_text("GENERATE " + json.dumps({"model": "fake-model", "prompt": [1],
                                                   "stream_id": 1, "max_tokens": 3}))
            while '"finish_reason": "length"' not in ws.receive_text().replace(
                    '"finish_reason":"length"', '"finish_reason": "length"'):
                pass
            recorded.keeper.refresh()
            assert recorded.levels["llm_gateway_websockets_open"] == {
                (("protocol", "lmtp"),): 1}
    recorded.keeper.refresh()
    assert recorded.levels["llm_gateway_websockets_open"] == {(("protocol", "lmtp"),): 0}
    lmtp = {**OPENAI, "protocol": "lmtp"}
    assert len(recorded.observations("llm_gateway_time_to_first_token_seconds", **lmtp)) == 1
    assert recorded.count("llm_gateway_generation_tokens", **lmtp) == 3


class _Scripted:
    """An engine client that answers every generation with ``events``."""

    def __init__(self, *events):
        self.events = events

    async def generate(self, request):
        for event in self.events:
            yield event


def _final(reason, stop_reason=None, index=0):
    return FinalEvent(index=index, finish_reason=reason, stop_reason=stop_reason,
                      usage=Usage(prompt_tokens=3, completion_tokens=2, forced_tokens=1))


TOKEN = TokenEvent(token_id=1, text="a")
OUTCOMES = [
    ((TOKEN, _final("eos")), 1, "eos"),
    ((TOKEN, _final("abort", "timeout")), 1, "timeout"),
    ((ErrorEvent(kind="overloaded", message="busy"),), 1, "overloaded"),
    ((TOKEN, _final("length", index=0), _final("eos", index=1)), 2, "eos"),
    ((TOKEN, _final("abort", "timeout", index=0), _final("eos", index=1)), 2, "timeout"),
]


@pytest.mark.parametrize(("events", "n", "outcome"), OUTCOMES)
async def test_a_generations_outcome(recorded, events, n, outcome):
    engine = InstrumentedEngine(_Scripted(*events), model="m", engine="k",
                                metrics=recorded.metrics())
    request = GenerateRequest(request_id="r", model="m", prompt=TextPrompt(text="x"),
                              sampling=Sampling(n=n))
    assert [e async for e in engine.generate(request)] == list(events)
    assert recorded.count("llm_gateway_requests") == 1
    assert recorded.count("llm_gateway_requests", outcome=outcome) == 1
    finals = sum(isinstance(e, FinalEvent) for e in events)
    assert recorded.count("llm_gateway_forced_tokens") == finals


async def test_a_generation_the_client_left_is_aborted_and_no_longer_in_flight(recorded):
    engine = InstrumentedEngine(_Scripted(TOKEN, TOKEN, _final("eos")), model="m", engine="k",
                                metrics=recorded.metrics())
    request = GenerateRequest(request_id="r", model="m", prompt=TextPrompt(text="x"))
    async with aclosing(engine.generate(request)) as events:
        assert await anext(events) == TOKEN
    assert recorded.count("llm_gateway_requests", outcome="aborted") == 1
    assert recorded.count("llm_gateway_generation_tokens") == 1  # what it had seen
    recorded.keeper.refresh()
    assert set(recorded.levels["llm_gateway_requests_in_flight"].values()) == {0}


def test_every_engine_series_is_declared_with_a_description(recorded):
    EngineMetrics(recorded)  # the stand-in checks names and descriptions


def test_vllms_figures_are_summed_per_step_and_sent_once_a_second(recorded, monkeypatch):
    from types import SimpleNamespace

    from engines.vllm import stats

    monkeypatch.setattr(stats, "engine_metrics", lambda: EngineMetrics(recorded))
    clock = [100.0]
    monkeypatch.setattr(stats.time, "monotonic", lambda: clock[0])
    logger = stats.SampledStats(SimpleNamespace(model_config=SimpleNamespace(
        served_model_name="m")))

    def step(prompt=0, generated=1, finished=0, running=2):
        cache = SimpleNamespace(queries=prompt, hits=prompt // 2)
        logger.record(SimpleNamespace(num_running_reqs=running, num_waiting_reqs=1,
                                      kv_cache_usage=0.25, prefix_cache_stats=cache),
                      SimpleNamespace(num_prompt_tokens=prompt, num_generation_tokens=generated,
                                      finished_requests=[object()] * finished))

    step(prompt=7)  # the first step is sent
    step(), step()  # within the second: kept
    assert recorded.count("llm_gateway_vllm_generation_tokens") == 1
    assert recorded.count("llm_gateway_vllm_prompt_tokens") == 7
    assert recorded.count("llm_gateway_vllm_prefix_cache_queries") == 7
    assert recorded.count("llm_gateway_vllm_prefix_cache_hits") == 3
    step(finished=1, running=0)  # a request finished: sent at once
    assert recorded.count("llm_gateway_vllm_generation_tokens") == 4
    assert recorded.count("llm_gateway_vllm_requests_finished") == 1
    stats.LEVELS.refresh()  # levels reach Ray from the levels' thread
    assert recorded.levels["llm_gateway_vllm_requests_running"] == {(("model", "m"),): 0}
    clock[0] += 1.5
    step(generated=2)  # a second later: sent
    assert recorded.count("llm_gateway_vllm_generation_tokens") == 6
    stats.LEVELS.refresh()
    assert recorded.levels["llm_gateway_vllm_kv_cache_usage"] == {(("model", "m"),): 0.25}


def test_a_counted_histogram_reads_as_prometheus_clients_own(recorded):
    """Oracle: prometheus_client's Histogram over the same values and buckets."""
    import prometheus_client

    bounds = (0.001, 0.01, 0.1, 1.0)
    values = [0.0005, 0.001, 0.002, 0.01, 0.05, 0.1, 0.7, 1.0, 3.0, 0.0]
    histogram = CountedHistogram(recorded, "llm_gateway_gaps", "Gaps.", bounds, ("model",),
                                 recorded.keeper)
    histogram.observe_all(values[:6], {"model": "a"})
    histogram.observe_all(values[6:], {"model": "a"})
    histogram.observe_all([2.0], {"model": "b"})
    recorded.keeper.refresh()
    oracle = prometheus_client.Histogram("gaps", "Gaps.", buckets=bounds,
                                         registry=prometheus_client.CollectorRegistry())
    for value in values:
        oracle.observe(value)
    expected = {sample.labels["le"]: sample.value for sample in oracle.collect()[0].samples
                if sample.name == "gaps_bucket"}
    ours = {dict(key)["le"]: value for key, value
            in recorded.levels["llm_gateway_gaps_bucket"].items() if ("model", "a") in key}
    assert ours == expected
    assert recorded.level("llm_gateway_gaps_count", model="a") == len(values)
    assert recorded.level("llm_gateway_gaps_sum", model="a") == pytest.approx(sum(values))
    assert recorded.level("llm_gateway_gaps_bucket", model="b", le="+Inf") == 1
    assert recorded.level("llm_gateway_gaps_bucket", model="b", le="1.0") == 0


def test_a_pipeline_stage_records_its_forward_time_and_what_its_caches_hold(recorded, tiny_dir,
                                                                         monkeypatch):
    import torch

    from engines.pipeline import stage
    from engines.pipeline.loading import load_layers

    monkeypatch.setattr(stage, "engine_metrics", lambda: EngineMetrics(recorded))
    tags = {"model": "m", "stage": "0:1-3"}
    core = stage.StageCore(load_layers(tiny_dir, 1, 3), 1, 3, metric_tags=tags,
                           levels=recorded.keeper)

    def hop(seq_id: str, first: int, length: int) -> stage.Hop:
        return stage.Hop.single(torch.randn(1, length, 64), torch.arange(first, first + length),
                                seq_id)

    core.forward(hop("a", 0, 7))
    core.forward(hop("b", 0, 5))
    core.forward(hop("a", 7, 1))
    recorded.keeper.refresh()
    key = tuple(sorted(tags.items()))
    assert len(recorded.observed["llm_gateway_pipeline_stage_seconds"][key]) == 3
    assert recorded.levels["llm_gateway_pipeline_stage_kv_tokens"][key] == 8 + 5
    assert recorded.levels["llm_gateway_pipeline_stage_sequences"][key] == 2
    assert recorded.levels["llm_gateway_pipeline_stage_kv_bytes"][key] == core.cache_bytes() > 0
    core.free("a"), core.free("b")
    recorded.keeper.refresh()
    assert recorded.levels["llm_gateway_pipeline_stage_kv_bytes"][key] == 0

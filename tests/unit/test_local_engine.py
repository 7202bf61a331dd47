"""A colocated model (ModelConfig.colocated): its config rules and the in-process engine client
the ingress uses for it (default deadline, bound on generations, abort on close)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from contract import (
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    Sampling,
    TextPrompt,
    TokenEvent,
)
from engines.kit.config import Autoscaling, ModelConfig
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.bounds import BoundedEngine, CloseStreamsWithRequest
from gateway.ingress.local_engine import LocalEngineClient
from gateway.ingress.registry import ModelRegistry
from tests.fake_engine import FakeEngine
from tests.serve_session import serve_in_thread


def _request(rid: str = "r", max_tokens: int = 40, timeout_s: float | None = None):
    return GenerateRequest(request_id=rid, model="m", prompt=TextPrompt(text="Hi"),
                           sampling=Sampling(max_tokens=max_tokens, ignore_eos=True),
                           timeout_s=timeout_s)


def test_a_colocated_model_adds_its_needs_to_the_ingress_replica():
    config = GatewayConfig(ingress_num_cpus=0.25, models=[
        ModelConfig(name="a", colocated=True, num_cpus=1.0, num_gpus=1.0,
                    resources={"llm_gateway_gpu_engine": 0.01}),
        ModelConfig(name="b")])
    assert config.ingress_actor_options() == {
        "num_cpus": 1.25, "num_gpus": 1.0, "resources": {"llm_gateway_gpu_engine": 0.01}}
    assert GatewayConfig(ingress_num_cpus=0.25).ingress_actor_options() == {"num_cpus": 0.25}


@pytest.mark.parametrize("extra", [{"app": "model-a"}, {"num_replicas": 2},
                                   {"autoscaling": Autoscaling(max_replicas=2)}])
def test_a_colocated_model_has_no_replicas_of_its_own(extra):
    with pytest.raises(ValueError, match="colocated model runs in the gateway's ingress"):
        ModelConfig(name="a", colocated=True, **extra)


def test_at_most_one_model_is_colocated():
    with pytest.raises(ValueError, match="at most one model can be colocated"):
        GatewayConfig(models=[ModelConfig(name="a", colocated=True),
                              ModelConfig(name="b", colocated=True)])


async def test_the_default_deadline_applies_unless_the_request_has_one():
    # The deadline is 20 token delays, the whole answer 60: some tokens, then the cut, even
    # on a loaded box (a deadline of 4 delays once saw no token at all before it).
    engine = FakeEngine(delay=0.05)
    client = BoundedEngine(LocalEngineClient(engine, "m"), "m", request_timeout_s=1.0)
    events = [e async for e in client.generate(_request("d", max_tokens=60))]
    final = events[-1]
    assert isinstance(final, FinalEvent) and (final.finish_reason, final.stop_reason) == (
        "abort", "timeout")
    assert 0 < sum(isinstance(e, TokenEvent) for e in events) < 60
    assert engine.requests[-1].timeout_s == 1.0
    [e async for e in client.generate(_request("own", max_tokens=2, timeout_s=5.0))]
    assert engine.requests[-1].timeout_s == 5.0


async def test_generations_beyond_the_bound_are_refused_as_overloaded_at_once():
    engine = FakeEngine(delay=0.05)
    client = BoundedEngine(LocalEngineClient(engine, "m"), "m", max_pending=1)
    first = client.generate(_request("first"))
    assert isinstance(await anext(first), TokenEvent)
    refused = [e async for e in client.generate(_request("second"))]
    assert len(refused) == 1 and isinstance(refused[0], ErrorEvent)
    assert refused[0].kind == "overloaded"
    assert [r.request_id for r in engine.requests] == ["first"]  # never reached the engine
    await first.aclose()
    assert client.pending == 0
    done = [e async for e in client.generate(_request("third", max_tokens=2))]
    assert isinstance(done[-1], FinalEvent)


async def test_closing_the_stream_aborts_the_engine_request():
    engine = FakeEngine(delay=0.02)
    client = LocalEngineClient(engine, "m")
    stream = client.generate(_request("gone"))
    await anext(stream)
    await stream.aclose()
    stats = await client.stats()
    assert (stats.active, stats.aborted) == (0, 1) and engine.cancelled == ["gone"]


def test_a_client_disconnect_through_the_app_aborts_the_engine_request():
    engine = FakeEngine(name="m", delay=0.05)
    client = LocalEngineClient(engine, "m")
    app = create_app(ModelRegistry({"m": client}), GatewayConfig(
        models=[ModelConfig(name="m", colocated=True)]))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        with http.stream("POST", "/v1/completions", json={
                "model": "m", "prompt": "Hi", "max_tokens": 40, "stream": True,
                "ignore_eos": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # leaving the block closes the connection mid-stream
        for _ in range(100):
            if engine.cancelled:
                break
            time.sleep(0.02)
    assert engine.cancelled == [engine.requests[0].request_id]
    assert asyncio.run(client.stats()).active == 0


def test_the_colocated_serve_config_binds_no_engine_deployment():
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from gateway.app import build_app

    root = Path(__file__).resolve().parents[2]
    serve_config = yaml.safe_load((root / "serve_config.colocated.yaml").read_text())
    ServeDeploySchema.model_validate(serve_config)
    args = serve_config["applications"][0]["args"]
    ingress = build_app(args)._bound_deployment
    assert ingress.init_args[0] == {}  # no engine deployment: the ingress hosts the engine
    assert ingress._replica_config.ray_actor_options["num_cpus"] == 0.25 + 0.5


async def test_a_generation_its_request_left_open_is_closed_when_the_response_is_over():
    """A route that stops reading a generation without closing it (an OpenAI stream ending at
    a backtrack did, in a replica running vLLM: the request ran on for minutes) does not leave
    it running once the response is over, whatever holds on to it; one another task is
    reading then ends at its next event."""
    engine = FakeEngine(name="m", delay=0.01)
    client = BoundedEngine(LocalEngineClient(engine, "m"), "m")
    held = []

    async def route(scope, receive, send):
        first = client.generate(_request("left", max_tokens=40))
        held.append(first)
        await anext(first)  # then left suspended, never closed
        second = client.generate(_request("read", max_tokens=40))
        held.append(asyncio.ensure_future(_drain(second)))  # a task reading it
        await asyncio.sleep(0.05)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    transport = httpx.ASGITransport(app=CloseStreamsWithRequest(route))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.get("/")).text == "ok"
    await asyncio.wait_for(held[1], 5)
    stats = await client.stats()
    assert (stats.active, stats.aborted) == (0, 2)
    assert sorted(engine.cancelled) == ["left", "read"]


async def _drain(events) -> None:
    async for _ in events:
        pass

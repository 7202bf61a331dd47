"""Prefix-aware routing end to end (docs/routing.md): a tiny random model on two vLLM replicas
in its own application (the default layout), behind the session's HAProxy, and a gateway
application naming it. A conversation's turns must land on the replica that served its earlier
turns, whether HAProxy sends them to the model's application (its ingress request router picks)
or the gateway's ingress sends them over the engine channel (Serve's request router in the
ingress picks); a killed replica moves the conversation, with no failed turn.

Oracles: the replica that answered (``x-llm-gateway-replica``, on the model replicas' own
answers) and vLLM's own count of prompt tokens its prefix cache already held
(``usage.prompt_tokens_details.cached_tokens``): on the replica holding the conversation, a turn
finds the earlier turn's prompt cached, save its partial last KV block; on the other, none of
it (each conversation has a system prompt of its own)."""

from __future__ import annotations

import itertools
import time
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest

from engines.kit.config import ModelConfig
from engines.kit.embedded import local_model_dir
from gateway.config import GatewayConfig
from gateway.model_routes import model_route
from tests.e2e.conftest import MODEL
from tests.pipeline_models import build_tiny
from tests.serve_session import VLLM_TEST_ARGS, _wait_healthy

pytestmark = pytest.mark.e2e

ROUTED, APP, GATEWAY_APP, GATEWAY_ROUTE = "tiny-routed", "routed", "routed-gateway", "/routed-gw"
REPLICA = "x-llm-gateway-replica"
# vLLM's KV block on its CPU backend (16 on a GPU): a cached prefix is a whole number of them.
BLOCK_TOKENS = 128
ENGINE_ARGS = {**VLLM_TEST_ARGS, "max_model_len": 2048, "kv_cache_memory_bytes": 64 << 20}


@pytest.fixture(scope="module")
def routed_url(gateway_url, tmp_path_factory):
    from ray import serve

    from gateway.app import build_app, build_model_app

    tokenizer = Path(local_model_dir(f"embedded:{MODEL}") or "")
    source = build_tiny("llama-wide", tmp_path_factory.mktemp("routed") / "llama", tokenizer)
    model = ModelConfig(name=ROUTED, source=str(source), num_replicas=2, num_cpus=0.05,
                        engine_args=ENGINE_ARGS)
    serve.run(build_model_app({"model": msgspec.to_builtins(model)}), name=APP,
              route_prefix=model_route(ROUTED))
    gateway = GatewayConfig(models=[msgspec.structs.replace(model, app=APP)],
                            ingress_num_cpus=0.05)
    serve.run(build_app(gateway), name=GATEWAY_APP, route_prefix=GATEWAY_ROUTE)
    _wait_healthy(f"{gateway_url}{GATEWAY_ROUTE}", "the routed model's gateway")
    yield gateway_url
    serve.delete(GATEWAY_APP)
    serve.delete(APP)


def _conversation() -> list[dict]:
    tag = uuid.uuid4().hex
    return [{"role": "system", "content": f"Conversation {tag}. You answer at length. " * 12}]


def _chat_turn(url: str, messages: list[dict], question: str) -> tuple[str, dict]:
    """One turn through HAProxy (the body names the model: its application); the replica
    that answered and the usage."""
    messages.append({"role": "user", "content": question})
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": ROUTED, "messages": messages, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return r.headers[REPLICA], body["usage"]


def _assert_held(previous_prompt: int, usage: dict) -> None:
    """The replica held every whole block of the previous turn's prompt."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= previous_prompt - BLOCK_TOKENS, (previous_prompt, usage)


def test_a_conversation_stays_on_the_replica_that_served_it(routed_url):
    """Two conversations, their turns interleaved: each keeps its replica, and each turn finds
    the earlier turns in that replica's prefix cache."""
    talks = [_conversation(), _conversation()]
    seen: list[list[tuple[str, dict]]] = [[], []]
    for turn in range(4):
        for i, messages in enumerate(talks):
            seen[i].append(_chat_turn(routed_url, messages, f"Tell me more, part {turn}. " * 6))
    for turns in seen:
        assert len({replica for replica, _ in turns}) == 1, turns
        for (_, before), (_, usage) in itertools.pairwise(turns):
            _assert_held(before["prompt_tokens"], usage)


def test_the_engine_channel_path_routes_by_prefix_too(routed_url):
    """Through the gateway's application (its ingress replica, Serve's request router there,
    the engine channel): the Responses API's usage says each turn found the earlier ones."""
    instructions = f"Conversation {uuid.uuid4().hex}. You answer at length. " * 12
    items: list[dict] = []
    previous = None
    for turn in range(4):
        items.append({"role": "user", "content": f"Tell me more, part {turn}. " * 6})
        r = httpx.post(f"{routed_url}{GATEWAY_ROUTE}/v1/responses", timeout=60, json={
            "model": ROUTED, "instructions": instructions, "input": items,
            "max_output_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        if previous is not None:
            cached = body["usage"]["input_tokens_details"]["cached_tokens"]
            assert cached >= previous - BLOCK_TOKENS, (previous, body["usage"])
        previous = body["usage"]["input_tokens"]
        items.append({"role": "assistant", "content": body["output"][0]["content"][0]["text"]})


def test_a_killed_replica_moves_the_conversation_without_a_failed_turn(routed_url):
    import ray

    messages = _conversation()
    first = [_chat_turn(routed_url, messages, f"Question {i}. " * 8)[0] for i in range(2)]
    assert first[0] == first[1]
    victim = ray.get_actor(f"SERVE_REPLICA::{APP}#engine-{ROUTED}#{first[0]}", namespace="serve")
    ray.kill(victim, no_restart=True)
    _wait_dead(victim)  # a request that reached it before it died would be one it held
    moved = [_chat_turn(routed_url, messages, f"And then {i}? " * 8) for i in range(3)]
    replicas = [replica for replica, _ in moved]
    assert first[0] not in replicas and len(set(replicas)) == 1, replicas
    # The new replica computed the history once, then holds it.
    _assert_held(moved[1][1]["prompt_tokens"], moved[2][1])
    _wait_for_two_replicas()


def _wait_dead(actor, timeout_s: float = 30) -> None:
    """``ray.kill`` only asks; wait until Ray reports the actor dead."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=1)
        except RayActorError:
            return
        except GetTimeoutError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the killed replica was not dead within {timeout_s:.0f} s")


def _wait_for_two_replicas(timeout_s: float = 300) -> None:
    """Serve replaces the killed replica; later tests of the module find two again."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = serve.status().applications[APP].deployments[f"engine-{ROUTED}"].replica_states
        if states.get("RUNNING", 0) == 2:
            return
        time.sleep(2)
    pytest.fail(f"the killed replica was not replaced within {timeout_s:.0f} s")

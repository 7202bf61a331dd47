"""Prefix-aware routing's policy (engines/caller/prefix_affinity.py) and HAProxy's router's reading of
request bodies (gateway/model_replica/router.py): keys that name whole prefixes, a conversation kept
on the replica that holds its history unless that replica is too loaded, a hot prefix spread
once its replica is, dead replicas forgotten, and the same keys from a raw body as from the
internal prompt the protocol makes of it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from contract import ChatMessage, ChatPrompt, GenerateRequest, TextPrompt, TokenPrompt
from engines.caller.prefix_affinity import (
    BLOCK_CHARS,
    MAX_BLOCKS,
    PrefixAffinity,
    RecentPrompts,
    prefix_blocks,
    prompt_text,
)
from engines.kit.config import ModelConfig, Routing
from gateway.model_replica.router import body_blocks

SYSTEM = "You are a careful assistant. " * 20  # about 560 characters: four blocks


def _chat(*turns: str) -> ChatPrompt:
    return ChatPrompt(messages=(ChatMessage(role="system", content=SYSTEM),
                                *(ChatMessage(role="assistant" if i % 2 else "user", content=t)
                                  for i, t in enumerate(turns))))


def _blocks(prompt) -> tuple[int, ...]:
    return prefix_blocks(prompt_text(prompt))


def test_keys_name_whole_prefixes():
    a, b = "x" * BLOCK_CHARS * 3, "x" * BLOCK_CHARS * 2 + "y" * BLOCK_CHARS
    ka, kb = prefix_blocks(a), prefix_blocks(b)
    assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]
    assert prefix_blocks("z" + a)[0] != ka[0]  # a key covers the text from the start
    assert prefix_blocks("x" * (BLOCK_CHARS - 1)) == ()  # no whole block, no key
    assert len(prefix_blocks("x" * BLOCK_CHARS * (MAX_BLOCKS + 10))) == MAX_BLOCKS
    # A conversation's next turn starts with every key of the one before.
    first, second = _blocks(_chat("What is 2+2?")), _blocks(_chat("What is 2+2?", "4.", "And 3+3?" * 40))
    assert second[:len(first)] == first and len(second) > len(first)


def test_a_conversation_stays_on_the_replica_that_holds_it():
    affinity = PrefixAffinity(max_imbalance=4, rng=random.Random(0))
    loads = {"r1": 0, "r2": 0}
    first = _blocks(_chat("Tell me about whales." * 10))
    pick = affinity.pick(first, loads)
    assert pick.reason == "load"
    affinity.record(first, pick.replica)
    later = _blocks(_chat("Tell me about whales." * 10, "Whales are mammals." * 10, "More?" * 30))
    again = affinity.pick(later, {**loads, pick.replica: 3})  # busier, within the bound
    assert (again.replica, again.reason, again.matched) == (pick.replica, "prefix", len(first))
    other = "r2" if pick.replica == "r1" else "r1"
    spilled = affinity.pick(later, {pick.replica: 5, other: 0})  # beyond it: the least loaded
    assert (spilled.replica, spilled.reason) == (other, "load")


def test_a_hot_prefix_spreads_and_then_balances_by_load():
    affinity = PrefixAffinity(max_imbalance=2, rng=random.Random(1))
    loads = {"r1": 0, "r2": 0}
    for i in range(12):  # new conversations sharing the system prompt, none finishing
        blocks = _blocks(_chat(f"question {i} " * 20))
        pick = affinity.pick(blocks, loads)
        assert pick.matched >= (4 if i else 0)  # all share the system prompt's four blocks
        affinity.record(blocks, pick.replica)
        loads[pick.replica] += 1
    assert abs(loads["r1"] - loads["r2"]) <= 2, loads


def test_dead_replicas_are_not_picked_and_published_records_are_learnt():
    affinity = PrefixAffinity(rng=random.Random(2))
    blocks = _blocks(_chat("hello " * 50))
    affinity.record(blocks, "gone")
    pick = affinity.pick(blocks, {"r1": 0, "r2": 1})
    assert (pick.replica, pick.reason) == ("r1", "load")
    # Another router sent the conversation to r2; r2's own record says so.
    recent = RecentPrompts()
    recent.note(GenerateRequest(request_id="r", model="m", prompt=_chat("hello " * 50)))
    affinity.learn({"r2": recent.keys(), "r1": []})
    follow = _blocks(_chat("hello " * 50, "hi!", "and then?" * 20))
    assert affinity.pick(follow, {"r1": 0, "r2": 1}).replica == "r2"


def test_memory_is_bounded():
    affinity = PrefixAffinity(memory_blocks=10)
    for i in range(20):
        affinity.record(prefix_blocks(f"{i:04d}" * BLOCK_CHARS), "r1")
    assert len(affinity._holders) == 10


def test_a_raw_body_has_the_keys_of_the_prompt_the_protocol_makes_of_it():
    chat = {"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": [
                                            {"type": "text", "text": "part one"},
                                            {"type": "text", "text": "part two " * 20}]}]}
    internal = ChatPrompt(messages=(ChatMessage(role="system", content=SYSTEM),
                                    ChatMessage(role="user", content="part one\n" + "part two " * 20)))
    assert body_blocks(json.dumps(chat).encode()) == _blocks(internal) != ()
    anthropic = {"model": "m", "system": SYSTEM, "max_tokens": 9, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "part one"},
                                     {"type": "text", "text": "part two " * 20}]}]}
    responses = {"model": "m", "instructions": SYSTEM,
                 "input": [{"role": "developer", "content": "Be brief."},
                           {"type": "message", "role": "user", "content": [
                               {"type": "input_text", "text": "part one"},
                               {"type": "input_text", "text": "part two " * 20}]}]}
    assert body_blocks(json.dumps(anthropic).encode()) == _blocks(internal)
    briefly = ChatPrompt(messages=(internal.messages[0], ChatMessage(role="system", content="Be brief."),
                                   internal.messages[1]))
    assert body_blocks(json.dumps(responses).encode()) == _blocks(briefly)
    one = {"instructions": SYSTEM, "input": "just this " * 20}
    assert body_blocks(json.dumps(one).encode()) == _blocks(ChatPrompt(messages=(
        ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content="just this " * 20))))
    text = "The capital of France is " * 20
    for body in ({"prompt": text}, {"prompt": [text, "other"]}, {"text_input": text},
                 {"inputs": text}):
        assert body_blocks(json.dumps(body).encode()) == _blocks(TextPrompt(text=text))
    ids = list(range(400))
    assert body_blocks(json.dumps({"prompt": ids}).encode()) == _blocks(TokenPrompt(token_ids=tuple(ids)))


def test_a_cut_or_odd_body_is_read_as_far_as_it_goes():
    body = json.dumps({"messages": [{"role": "user", "content": "word " * 2000}]}).encode()
    full = body_blocks(body)
    cut = body_blocks(body[:4000])  # HAProxy's buffer ended mid-string
    assert 0 < len(cut) < len(full) and full[:len(cut)] == cut
    for odd in (b"", b"not json", b"[1, 2]", b'{"messages": 3}', b'{"prompt": {"a": 1}}'):
        assert body_blocks(odd) == ()


@pytest.mark.parametrize(("model", "routed"), [
    ({}, False),
    ({"num_replicas": 2}, True),
    ({"autoscaling": {"min_replicas": 1, "max_replicas": 3}}, True),
    ({"num_replicas": 2, "routing": {"policy": "load"}}, False),
])
def test_a_model_routes_by_prefix_when_it_has_replicas_to_choose_from(model, routed):
    assert msgspec.convert(model, ModelConfig).routes_by_prefix() is routed


def test_the_imbalance_bound_scales_with_what_a_replica_holds():
    assert ModelConfig(num_replicas=2).routing_imbalance() == 32  # vLLM: 2 x 128 sequences / 8
    assert ModelConfig(num_replicas=2, max_ongoing_requests=8).routing_imbalance() == 4
    assert ModelConfig(num_replicas=2, routing=Routing(max_imbalance=0)).routing_imbalance() == 0


def test_routing_settings_are_checked():
    with pytest.raises(ValueError, match="max_imbalance"):
        Routing(max_imbalance=-1)


def test_the_router_class_survives_serves_pickling_by_value(tmp_path):
    """Serve pickles a request router's module by value into each routing process; what the
    router checks requests against must come from elsewhere, or a RouteQuery made by HAProxy's
    router would not be one there (every request would be routed by load, as happened)."""
    from ray import cloudpickle

    import engines.caller.prefix_router

    cloudpickle.register_pickle_by_value(engines.caller.prefix_router)
    try:
        (tmp_path / "router.pkl").write_bytes(
            cloudpickle.dumps(engines.caller.prefix_router.PrefixAwareRouter))
    finally:
        cloudpickle.unregister_pickle_by_value(engines.caller.prefix_router)
    child = textwrap.dedent(f"""
        import engines.caller.prefix_router, engines.caller.routing
        from ray import cloudpickle
        copy = cloudpickle.loads(open({str(tmp_path / "router.pkl")!r}, "rb").read())
        assert copy is not engines.caller.prefix_router.PrefixAwareRouter  # a copy, as in Serve
        assert copy.choose_replicas.__globals__["request_blocks"] is engines.caller.routing.request_blocks
        """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]

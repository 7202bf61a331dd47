"""LMTP end to end with raw frames (``websockets`` client) against real vLLM behind Ray Serve."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest
import websockets

from tests.e2e.conftest import MODEL, assert_greedy_or_near_tie

PROMPT = "The capital of France is"


def _ws_url(gateway_url: str, path: str = "/") -> str:
    return gateway_url.replace("http://", "ws://") + path


@pytest.fixture(scope="module")
def prompt_ids(gateway_url) -> list[int]:
    return httpx.post(f"{gateway_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]


async def _send(ws, command: str, payload: dict) -> None:
    await ws.send(f"{command} {json.dumps(payload)}")


async def _collect(ws, stream_ids, timeout=120) -> dict:
    """Read frames until every stream in ``stream_ids`` ended; returns id → [(kind, item)]."""
    out = {sid: [] for sid in stream_ids}
    open_ids = set(stream_ids)
    async with asyncio.timeout(timeout):
        while open_ids:
            kind, _, body = (await ws.recv()).partition(" ")
            items = json.loads(body)
            assert isinstance(items, list)
            for item in items:
                sid = item["stream_id"]
                assert sid in out, f"item for a stream this connection never opened: {item}"
                assert sid in open_ids, f"item after the stream ended: {item}"
                out[sid].append((kind, item))
                if kind == "MSG" or item.get("error") is not None or item.get("finish_reason"):
                    open_ids.discard(sid)
    return out


async def _generate(ws, sid, prompt, **kwargs) -> list[dict]:
    await _send(ws, "GENERATE", {"model": MODEL, "prompt": prompt, "stream_id": sid, **kwargs})
    return [item for _, item in (await _collect(ws, [sid]))[sid]]


async def test_greedy_generate_matches_vllm_native(gateway_url, engine_handle, prompt_ids,
                                                  logprob_tolerance):
    native = await engine_handle.reference_greedy.remote(prompt_ids, 12)
    async with websockets.connect(_ws_url(gateway_url)) as ws:
        items = await _generate(ws, 1, prompt_ids, max_tokens=12)
    assert [i["token"] for i in items] == native.token_ids  # exactly once each
    assert [i["finish_reason"] for i in items] == [None] * 11 + ["length"]
    for item, logprob in zip(items, native.logprobs, strict=True):
        # The same kernels, but not the same batch: bf16 is not batch-invariant (3e-4 seen).
        assert item["logprob"] == pytest.approx(logprob, abs=logprob_tolerance)
        assert item["stream_id"] == 1 and str(item["token"]) in item["top_logprobs"]


async def test_default_max_tokens_and_top_logprobs(gateway_url, engine_handle, prompt_ids):
    native = await engine_handle.reference_greedy.remote(prompt_ids, 32)  # LMTP's default
    async with websockets.connect(_ws_url(gateway_url, "/lmtp")) as ws:
        items = await _generate(ws, 7, prompt_ids, top_logprobs=3, temperature=0.0)
    assert [i["token"] for i in items] == native.token_ids
    expected_finish = "length" if len(items) == 32 else "stop"  # EOS may come first
    assert items[-1]["finish_reason"] == expected_finish
    for item in items:
        keys = list(item["top_logprobs"])
        assert keys[0] == str(item["token"]) and 1 <= len(keys) <= 4
        assert all(v <= 0 for v in item["top_logprobs"].values())


async def test_eos_ends_with_stop(gateway_url, engine_handle, http):
    chat = http.post("/tokenize", json={"messages": [
        {"role": "user", "content": "Reply with just the word yes."}]}).json()["tokens"]
    native = await engine_handle.reference_greedy.remote(chat, 64)
    async with websockets.connect(_ws_url(gateway_url)) as ws:
        items = await _generate(ws, 1, chat, max_tokens=64)
    assert [i["token"] for i in items] == native.token_ids
    assert items[-1]["finish_reason"] == "stop" and items[-1]["token"] == 2  # <|im_end|>


async def test_logit_bias_allow_list_applies_to_every_step(gateway_url, prompt_ids):
    allowed = [330, 331, 332]
    async with websockets.connect(_ws_url(gateway_url)) as ws:
        items = await _generate(ws, 1, prompt_ids, max_tokens=6,
                                logit_bias={str(t): 100 for t in allowed})
    assert len(items) == 6 and all(i["token"] in allowed for i in items)


async def test_biased_logprobs_are_normalised_over_the_biased_distribution(gateway_url,
                                                                          prompt_ids):
    allowed = [330, 331, 332]
    async with websockets.connect(_ws_url(gateway_url)) as ws:
        items = await _generate(ws, 1, prompt_ids, max_tokens=3, top_logprobs=3,
                                logit_bias={str(t): 100 for t in allowed})
    for item in items:
        # +100 on an allow-list: log_softmax(logits + bias) puts ~all mass on the allowed ids
        assert set(item["top_logprobs"]) == {str(t) for t in allowed}
        assert sum(math.exp(v) for v in item["top_logprobs"].values()) == pytest.approx(1, abs=1e-3)


async def test_score_matches_generate_logprobs(gateway_url, prompt_ids, logprob_tolerance):
    async with websockets.connect(_ws_url(gateway_url)) as ws:
        generated = await _generate(ws, 1, prompt_ids, max_tokens=5)
        tokens = [i["token"] for i in generated]
        await _send(ws, "SCORE", {"model": MODEL, "prompt": prompt_ids, "scored": tokens,
                                  "stream_id": 2})
        scored = [item for _, item in (await _collect(ws, [2]))[2]]
    assert [i["token"] for i in scored] == tokens
    assert [i["finish_reason"] for i in scored] == [None] * 4 + ["stop"]
    assert all("top_logprobs" not in i for i in scored)
    for s, g in zip(scored, generated, strict=True):
        assert s["logprob"] == pytest.approx(g["logprob"], abs=logprob_tolerance)


async def test_model_info_answers_fast(gateway_url):
    async with websockets.connect(_ws_url(gateway_url)) as ws:
        started = time.monotonic()
        await _send(ws, "MODEL_INFO", {"model": MODEL, "stream_id": 1, "data": {"model": MODEL}})
        [(kind, item)] = (await _collect(ws, [1], timeout=5))[1]
    assert kind == "MSG" and item["model_info"]["model"] == MODEL
    assert item["model_info"]["max_model_len"] == 2048
    assert time.monotonic() - started < 5


def _greedy_or_near_tie(items: list[dict], reference: list[int], tolerance: float) -> None:
    # LMTP keys top_logprobs by the token id as a string
    assert_greedy_or_near_tie([str(i["token"]) for i in items],
                              [i.get("top_logprobs", {}) for i in items],
                              [str(t) for t in reference], tolerance)


async def test_interleaved_streams_on_one_connection(gateway_url, engine_handle, prompt_ids,
                                                     logprob_tolerance):
    other = prompt_ids[:-1]
    expected = {1000: (await engine_handle.reference_greedy.remote(prompt_ids, 8)).token_ids,
                3: (await engine_handle.reference_greedy.remote(other, 8)).token_ids}
    async with websockets.connect(_ws_url(gateway_url)) as ws:
        await _send(ws, "GENERATE", {"model": MODEL, "prompt": prompt_ids, "stream_id": 1000,
                                     "max_tokens": 8, "top_logprobs": 2})
        await _send(ws, "GENERATE", {"model": MODEL, "prompt": other, "stream_id": 3,
                                     "max_tokens": 8, "top_logprobs": 2})
        out = await _collect(ws, [1000, 3])
    assert set(out) == set(expected)
    for sid, items in out.items():
        _greedy_or_near_tie([i for _, i in items], expected[sid], logprob_tolerance)


async def test_two_connections_same_stream_id_do_not_mix(gateway_url, engine_handle, prompt_ids,
                                                         logprob_tolerance):
    prompts = [prompt_ids, prompt_ids[:3]]
    expected = [(await engine_handle.reference_greedy.remote(p, 10)).token_ids for p in prompts]

    async def run(prompt):
        async with websockets.connect(_ws_url(gateway_url)) as ws:
            return await _generate(ws, 1, prompt, max_tokens=10, top_logprobs=2)

    got = await asyncio.gather(*(run(p) for p in prompts))
    for items, reference in zip(got, expected, strict=True):
        _greedy_or_near_tie(items, reference, logprob_tolerance)


@pytest.mark.parametrize(("command", "payload", "fragment"), [
    ("GENERATE", {"model": "no-such-model", "prompt": [1]}, "no-such-model"),
    ("GENERATE", {"model": MODEL, "prompt": []}, "empty"),
    ("GENERATE", {"model": MODEL, "prompt": [1, 10**7]}, "vocabulary"),
    ("GENERATE", {"model": MODEL, "prompt": [1], "logit_bias": {"99999999": 100}}, "vocabulary"),
    ("GENERATE", {"model": MODEL, "prompt": [1], "max_tokens": 0}, "max_tokens"),
    ("GENERATE", {"model": MODEL, "prompt": [1], "max_tokens": 4096}, "context"),
    ("GENERATE", {"model": MODEL, "prompt": [1], "length_penalty": 1.0}, "length_penalty"),
    ("GENERATE", {"model": MODEL, "prompt": [1], "top_logprobs": 50}, "logprobs"),
    ("GENERATE", {"model": MODEL}, "prompt"),
    ("SCORE", {"model": MODEL, "prompt": [1], "scored": []}, "scored"),
    ("SCORE", {"model": MODEL, "prompt": [1]}, "scored"),
])
async def test_errors_are_token_items_and_the_connection_stays_usable(
        gateway_url, prompt_ids, command, payload, fragment):
    async with websockets.connect(_ws_url(gateway_url)) as ws:
        await _send(ws, command, {**payload, "stream_id": 1})
        [(kind, item)] = (await _collect(ws, [1]))[1]
        assert kind == "TOKEN" and fragment in item["error"]
        items = await _generate(ws, 2, prompt_ids, max_tokens=2)
        assert items[-1]["finish_reason"] == "length"


async def test_unknown_command_and_malformed_frames_keep_other_streams(gateway_url, prompt_ids):
    async with websockets.connect(_ws_url(gateway_url)) as ws:
        await _send(ws, "GENERATE", {"model": MODEL, "prompt": prompt_ids, "stream_id": 1,
                                     "max_tokens": 20})
        await _send(ws, "FOO", {"stream_id": 2})
        await ws.send("NOSPACE")
        await ws.send('GENERATE {"stream_id": 3, "prompt": [1,')
        out = await _collect(ws, [1, 2, None, 3])
    # On TOKEN: LMQL reads a stream's errors only there (issue 15's finding).
    assert out[2] == [("TOKEN", {"stream_id": 2, "error": "Unknown command: FOO"})]
    assert out[None][0][0] == "MSG" and "malformed" in out[None][0][1]["error"]
    assert out[3][0][0] == "TOKEN" and "JSON" in out[3][0][1]["error"]
    assert len(out[1]) == 20 and out[1][-1][1]["finish_reason"] == "length"


async def test_disconnect_aborts_the_connections_requests(gateway_url, prompt_ids, http):
    before = http.get("/gateway/engines").json()[MODEL]["aborted"]
    async with websockets.connect(_ws_url(gateway_url)) as ws:
        for sid in (1, 2):
            await _send(ws, "GENERATE", {"model": MODEL, "prompt": prompt_ids, "stream_id": sid,
                                         "max_tokens": 1500})
        await ws.recv()  # both are running
    deadline = time.monotonic() + 30
    stats = http.get("/gateway/engines").json()[MODEL]
    while time.monotonic() < deadline and (stats["active"] or stats["aborted"] < before + 2):
        await asyncio.sleep(0.5)
        stats = http.get("/gateway/engines").json()[MODEL]
    assert stats["aborted"] == before + 2 and stats["active"] == 0


async def test_a_logit_bias_over_most_of_the_vocabulary_is_applied(gateway_url, prompt_ids,
                                                                    engine_handle):
    """40,000 of SmolLM2's 49,152 ids banned at -100 (the size of logit_bias the issue's LMQL
    query sent): every sampled token is one of the others, on several concurrent streams."""
    vocab_size = (await engine_handle.model_info.remote()).vocab_size
    allowed = set(range(40_000, vocab_size))
    bias = {str(t): -100 for t in range(40_000)}
    async with websockets.connect(_ws_url(gateway_url), max_size=None) as ws:
        for sid in (1, 2, 3):
            await _send(ws, "GENERATE", {"model": MODEL, "prompt": prompt_ids, "stream_id": sid,
                                         "max_tokens": 12, "temperature": 1.0,
                                         "logit_bias": bias})
        streams = await _collect(ws, [1, 2, 3])
    for items in streams.values():
        tokens = [item["token"] for _, item in items]
        assert all(item.get("error") is None for _, item in items), items
        assert len(tokens) == 12 and set(tokens) <= allowed, tokens

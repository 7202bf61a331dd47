"""OpenAI protocol end to end: openai SDK → Ray Serve ingress → vLLM replica (embedded model)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.e2e.aborts import drop_stream, engine_stats, wait_for_abort
from tests.e2e.conftest import MODEL, assert_greedy_or_near_tie

PROMPT = "The capital of France is"


def _native(engine_handle, prompt: str, max_tokens: int):
    return engine_handle.reference_greedy.remote(prompt, max_tokens).result()


def test_models_list_has_id_and_root(openai_client):
    models = openai_client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].root == MODEL  # not the model's path: expose_model_paths is off
    assert openai_client.models.retrieve(MODEL).id == MODEL


def test_completion_greedy_matches_vllm_native(openai_client, engine_handle):
    native = _native(engine_handle, PROMPT, 24)
    result = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                              temperature=0)
    assert result.choices[0].text == native.text
    assert result.usage.prompt_tokens == len(native.prompt_token_ids)
    assert result.usage.completion_tokens == len(native.token_ids)
    assert "Paris" in result.choices[0].text


def test_completion_stream_equals_non_stream_and_reports_usage(openai_client):
    full = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                            temperature=0)
    stream = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_greedy_matches_vllm_native_on_the_rendered_template(openai_client, engine_handle,
                                                                   http):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    rendered = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert rendered.startswith("<|im_start|>system\nYou are a helpful")  # SmolLM2's template
    native = _native(engine_handle, rendered, 20)
    chat = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                 temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == native.text
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.prompt_tokens == len(tokens)


def test_chat_stream(openai_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                  max_completion_tokens=12, temperature=0)
    full = openai_client.chat.completions.create(**kwargs)
    chunks = list(openai_client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_n2_returns_two_choices(openai_client):
    result = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2,
                                              temperature=1.0, seed=1234)
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert all(c.text for c in result.choices)
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2, seed=7)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_seed_makes_sampling_reproducible(openai_client):
    runs = [openai_client.completions.create(model=MODEL, prompt="Once upon a time",
                                             max_tokens=12, temperature=1.0, seed=42)
            .choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


def test_completion_logprobs(openai_client):
    result = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                              temperature=0, logprobs=3)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == result.choices[0].text
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0
        assert 1 <= len(top) <= 3
        # greedy: the chosen token is the most likely one
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)
        assert top.get(chosen) == pytest.approx(logprob, abs=1e-4)


def test_chat_logprobs(openai_client):
    result = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)


def test_stop_string(openai_client):
    free = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                            temperature=0).choices[0].text
    assert "." in free
    stopped = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                               temperature=0, stop=["."])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == free.split(".")[0]


def test_ignore_eos_and_usage_counts(openai_client, http):
    prompt_tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    result = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 40
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.total_tokens == prompt_tokens + 40


def test_tokenize_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT,
                                          "add_special_tokens": False}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    assert http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json() == {
        "prompt": PROMPT}


async def test_concurrent_streams_do_not_mix(async_openai_client, logprob_tolerance):
    prompts = [f"Count from {i}:" for i in range(6)]

    async def one(prompt):
        tokens, tops = [], []
        stream = await async_openai_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True, logprobs=2)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                tokens += chunk.choices[0].logprobs.tokens
                tops += chunk.choices[0].logprobs.top_logprobs
        full = await async_openai_client.completions.create(model=MODEL, prompt=prompt,
                                                            max_tokens=10, temperature=0,
                                                            logprobs=2)
        return tokens, tops, full.choices[0].logprobs.tokens

    for streamed, tops, whole in await asyncio.gather(*(one(p) for p in prompts)):
        assert len(streamed) == len(whole) == 10
        # the two requests ran in different batches: greedy text can fork at a near-tie
        assert_greedy_or_near_tie(streamed, tops, whole, logprob_tolerance)


def test_client_disconnect_aborts_engine_request(gateway_url, http):
    before = engine_stats(http, MODEL)["aborted"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=gateway_url, timeout=60) as client:
        drop_stream(client, "/v1/completions", body, prefix="data: ")
    stats = wait_for_abort(http, MODEL, before)
    assert stats["aborted"] == before + 1
    assert stats["active"] == 0


# --- bad input: OpenAI-shaped 4xx, never a 500 ----------------------------------------------


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and "type" in error and "param" in error
    return error


def test_unknown_model_is_404_via_sdk(openai_client):
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert info.value.status_code == 404
    assert "no-such-model" in info.value.body["message"]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"max_tokens": 5000}, "max_tokens"),  # beyond the 2048-token context
])
def test_bad_sampling_is_400_via_sdk(openai_client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param


def test_bad_input_in_a_stream_is_a_status_not_a_200_stream(http):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                  "max_tokens": 0, "stream": True})
    _error(response, 400)


def test_greedy_n2_refused_by_vllm_is_400_not_500(http):
    _error(http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 2,
                                              "temperature": 0, "max_tokens": 2}), 400)


def test_prompt_too_long_is_400(http):
    error = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": "hello " * 3000,
                                                      "max_tokens": 4}), 400)
    assert "context length" in error["message"]


def test_out_of_vocab_token_prompt_is_400(http):
    _error(http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 10**9]}), 400)


def test_malformed_json_and_missing_fields_are_400(http):
    headers = {"content-type": "application/json"}
    _error(http.post("/v1/completions", content=b'{"model": ', headers=headers), 400)
    _error(http.post("/v1/completions", content=json.dumps({"model": MODEL}),
                     headers=headers), 400)
    _error(http.post("/v1/chat/completions", json={"model": MODEL}), 400)
    _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}), 400)


def test_gateway_still_serves_after_bad_requests(openai_client):
    result = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                              temperature=0)
    assert result.usage.completion_tokens == 3


@pytest.mark.parametrize("field", ["priority", "seed"])
def test_integers_beyond_64_bits_are_400_not_an_engine_failure(http, field):
    """Through real vLLM they failed in its engine core's msgpack, answered as a 500."""
    error = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                      "max_tokens": 2, field: 2**64}), 400)
    assert field in error["message"]


def test_a_fanout_beyond_the_default_bound_is_400_before_any_engine_request(http):
    error = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 129,
                                                      "n": 2, "max_tokens": 1}), 400)
    assert error["param"] == "prompt" and "at most 256" in error["message"]


def test_echo_with_logprobs_scores_the_prompt_as_a_loglikelihood_harness_reads_it(
        openai_client, logprob_tolerance):
    """lm-evaluation-harness's loglikelihood: echo, logprobs=1, max_tokens=1, then the prompt's
    own token logprobs past the context. Scoring prompt + a greedy continuation gives, at the
    continuation's positions, the logprobs vLLM gave those tokens while generating them."""
    made = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                            temperature=0, logprobs=1)
    generated = made.choices[0].logprobs
    scored = openai_client.completions.create(model=MODEL, prompt=PROMPT + made.choices[0].text,
                                              max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = scored.choices[0].logprobs
    prompt_tokens = scored.usage.prompt_tokens
    assert len(lp.tokens) == prompt_tokens + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == scored.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    continuation = lp.token_logprobs[prompt_tokens - 6:prompt_tokens]
    assert lp.tokens[prompt_tokens - 6:prompt_tokens] == generated.tokens
    for got, want in zip(continuation, generated.token_logprobs, strict=True):
        assert got == pytest.approx(want, abs=logprob_tolerance)
    for i in range(prompt_tokens - 6, prompt_tokens):  # greedy: each tops its position (or ties)
        assert max(lp.top_logprobs[i].values()) - lp.token_logprobs[i] <= logprob_tolerance


def test_prompt_logprobs_in_vllms_shape_score_what_vllm_generated(
        openai_client, engine_handle, logprob_tolerance):
    """vLLM's ``prompt_logprobs`` (extra body), read through the SDK: scoring prompt + vLLM's
    own greedy continuation gives, at the continuation's positions, the logprobs vLLM gave
    those tokens while generating them, each ranked first (or tied with the first)."""
    native = _native(engine_handle, PROMPT, 6)
    scored = openai_client.completions.create(
        model=MODEL, prompt=native.prompt_token_ids + native.token_ids, max_tokens=1,
        temperature=0, extra_body={"prompt_logprobs": 2})
    entries = scored.choices[0].model_extra["prompt_logprobs"]
    ids = native.prompt_token_ids + native.token_ids
    assert len(entries) == len(ids) and entries[0] is None
    start = len(native.prompt_token_ids)
    for i, token_id in enumerate(ids[1:], start=1):
        entry = {int(key): value for key, value in entries[i].items()}
        own = entry[token_id]
        tops = sorted((v["rank"], v["logprob"]) for k, v in entry.items() if v["rank"] <= 2)
        assert [rank for rank, _ in tops] == [1, 2] and tops[0][1] >= tops[1][1]
        assert own["rank"] >= 1 and own["decoded_token"]
        if i >= start:  # vLLM's own greedy pick: its logprob, at the top up to a tie
            assert own["logprob"] == pytest.approx(native.logprobs[i - start],
                                                   abs=logprob_tolerance)
            assert tops[0][1] - own["logprob"] <= logprob_tolerance

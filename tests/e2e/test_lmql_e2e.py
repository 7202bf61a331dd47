"""LMQL's own client and full LMQL queries against the gateway (the `lmql serve-model` drop-in)."""

from __future__ import annotations

import aiohttp
import httpx
import lmql  # a test dependency: missing it must fail the suite, not skip these tests
import pytest

from tests.e2e.conftest import MODEL

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model_dir() -> str:
    from engines.kit.embedded import local_model_dir

    path = local_model_dir(f"embedded:{MODEL}")  # the session gateway has prepared it
    assert path is not None
    return path


@pytest.fixture(scope="module")
def lmql_tokenizer(model_dir):
    from lmql.runtime.tokenizer import tokenizer

    return tokenizer(model_dir)


def _model(gateway_url, model_dir, **kwargs):
    return lmql.model(MODEL, endpoint=gateway_url.removeprefix("http://"), tokenizer=model_dir,
                      **kwargs)


async def _native_text(engine_handle, lmql_tokenizer, text: str, max_tokens: int) -> str:
    """vLLM's greedy continuation of exactly the ids LMQL sends (it prepends BOS itself)."""
    ids = [lmql_tokenizer.bos_token_id, *lmql_tokenizer(text)["input_ids"]]
    native = await engine_handle.reference_greedy.remote(ids, max_tokens)
    return native.text


async def test_websocket_client_generate_score_model_info(gateway_url, logprob_tolerance):
    from lmql.models.lmtp.lmtp_client import LMTPWebSocketClient

    ids = httpx.post(f"{gateway_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    async with aiohttp.ClientSession() as session, session.ws_connect(gateway_url) as ws:
        client = LMTPWebSocketClient(MODEL, ws)
        client.connect()
        generated = [t async for t in client.generate(ids, max_tokens=6, temperature=0.0,
                                                      top_logprobs=2)]
        assert len(generated) == 6 and generated[-1]["finish_reason"] == "length"
        tokens = [t["token"] for t in generated]
        scored = [t async for t in client.score(ids, tokens)]
        assert [t["token"] for t in scored] == tokens
        for s, g in zip(scored, generated, strict=True):
            assert s["logprob"] == pytest.approx(g["logprob"], abs=logprob_tolerance)
        info = await client.request("MODEL_INFO", {"model": MODEL})
        assert info["model_info"]["model"] == MODEL


async def test_argmax_with_length_constraint_matches_vllm_greedy(
        gateway_url, model_dir, engine_handle, lmql_tokenizer):
    result = await lmql.run(f'argmax "{PROMPT}[ANSWER]" where len(TOKENS(ANSWER)) < 8',
                            model=_model(gateway_url, model_dir))
    answer = result.variables["ANSWER"]
    native = await _native_text(engine_handle, lmql_tokenizer, PROMPT, 16)
    assert answer and native.startswith(answer)
    assert len(lmql_tokenizer(answer)["input_ids"]) < 8


async def test_stops_at_across_several_chunked_requests(
        gateway_url, model_dir, engine_handle, lmql_tokenizer):
    prompt = "Here is a list of colors: red, green,"
    result = await lmql.run(
        f'argmax "{prompt}[COLORS]" where STOPS_AT(COLORS, ".") and len(TOKENS(COLORS)) < 24',
        model=_model(gateway_url, model_dir, chunksize=3))
    colors = result.variables["COLORS"]
    native = await _native_text(engine_handle, lmql_tokenizer, prompt, 24)
    assert colors and native.startswith(colors)
    # chunksize=3 forces several GENERATE requests; a duplicated token would break the prefix
    assert len(lmql_tokenizer(colors)["input_ids"]) > 3


async def test_choice_constraint(gateway_url, model_dir):
    result = await lmql.run(
        'argmax "Q: Is Paris in France? Answer yes or no.\\nA:[ANSWER]" '
        'where ANSWER in [" yes", " no"]', model=_model(gateway_url, model_dir))
    assert result.variables["ANSWER"] in (" yes", " no")


async def test_sampled_query_with_constraint(gateway_url, model_dir):
    result = await lmql.run(
        'sample(temperature=0.8) "Once upon a time[STORY]" where len(TOKENS(STORY)) < 10',
        model=_model(gateway_url, model_dir))
    story = result.variables["STORY"] if not isinstance(result, list) else result[0].variables[
        "STORY"]
    assert story


async def test_sampled_query_whose_constraint_masks_half_the_vocabulary(
        gateway_url, model_dir, lmql_tokenizer, monkeypatch):
    """``not "e" in STORY`` bans every token containing an "e" (49 % of SmolLM2's vocabulary):
    LMQL sends the smaller side of its mask as logit_bias, here ~24,000 entries at -100 per
    GENERATE. Refused before (at most 1024 entries: LMQL raised LMTPStreamError)."""
    from lmql.models.lmtp.lmtp_client import LMTPWebSocketClient

    sent: list[int] = []
    original = LMTPWebSocketClient.generate

    def recording(self, prompt, **kwargs):
        sent.append(len(kwargs.get("logit_bias") or {}))
        return original(self, prompt, **kwargs)

    monkeypatch.setattr(LMTPWebSocketClient, "generate", recording)
    result = await lmql.run(
        'sample(temperature=0.8) "A short story: Once upon a time[STORY]" '
        'where not "e" in STORY and len(TOKENS(STORY)) < 16',
        model=_model(gateway_url, model_dir))
    result = result[0] if isinstance(result, list) else result
    story = result.variables["STORY"]
    vocab = lmql_tokenizer.vocab_size
    print(f"logit_bias entries per GENERATE: {sent} (vocabulary {vocab}); story {story!r}")
    assert sent and max(sent) > 0.45 * vocab, (sent, vocab)
    assert story and "e" not in story, story

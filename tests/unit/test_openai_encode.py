"""OpenAI stream encoders as pure async-generator transforms."""

import json

from contract import (
    ErrorEvent,
    FinalEvent,
    PromptEvent,
    PromptToken,
    TokenEvent,
    TopLogprob,
    Usage,
)
from protocols.openai.encode import (
    ChunkMeta,
    chat_chunks,
    collect,
    completion_chunks,
    completion_response,
    prompt_scores,
    sse,
    with_echo,
)
from tests.streams import _aiter, _list

META = ChunkMeta(id="cmpl-1", created=1, model="m")


def _tokens(text, index=0, logprobs=False):
    return [TokenEvent(index=index, token_id=ord(c), text=c,
                       logprob=-1.0 if logprobs else None, token_text=c if logprobs else None,
                       top_logprobs=(TopLogprob(token_id=ord(c), text=c, logprob=-1.0),)
                       if logprobs else ())
            for c in text]


def _final(index=0, reason="length", completion=2, stop_reason=None):
    return FinalEvent(index=index, finish_reason=reason, stop_reason=stop_reason,
                      usage=Usage(prompt_tokens=3, completion_tokens=completion))


async def test_completion_chunks_one_per_token_then_finish_then_usage():
    events = [*_tokens("ab"), _final()]
    chunks = await _list(completion_chunks(_aiter(events), META, logprobs=False, usage="final"))
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["a", "b"]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == []
    assert chunks[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["object"] == "text_completion" and c["id"] == "cmpl-1" for c in chunks)


async def test_completion_chunks_without_usage_have_no_usage_chunk():
    chunks = await _list(completion_chunks(_aiter([*_tokens("a"), _final(completion=1)]), META,
                                           logprobs=False, usage="none"))
    assert len(chunks) == 2 and all(c["choices"] for c in chunks)


async def test_continuous_usage_rides_every_chunk():
    chunks = await _list(completion_chunks(_aiter([*_tokens("ab"), _final()]), META,
                                           logprobs=False, usage="continuous"))
    assert [c["usage"]["completion_tokens"] for c in chunks[:2]] == [1, 2]


async def test_completion_logprobs_and_text_offsets():
    chunks = await _list(completion_chunks(_aiter([*_tokens("ab", logprobs=True), _final()]),
                                           META, logprobs=True, usage="none"))
    lp = chunks[1]["choices"][0]["logprobs"]
    assert lp == {"tokens": ["b"], "token_logprobs": [-1.0], "top_logprobs": [{"b": -1.0}],
                  "text_offset": [1]}


async def test_eos_and_stop_sequence_map_to_stop():
    for reason in ("eos", "stop_sequence"):
        chunks = await _list(completion_chunks(_aiter([_final(reason=reason)]), META,
                                               logprobs=False, usage="none"))
        assert chunks[0]["choices"][0]["finish_reason"] == "stop"


async def test_chat_chunks_role_first_every_chunk_has_delta():
    events = [*_tokens("hi"), _final()]
    chunks = await _list(chat_chunks(_aiter(events), META, choices=1, logprobs=False,
                                     usage="final"))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["h", "i"]
    assert chunks[3]["choices"][0]["finish_reason"] == "length"
    assert all("delta" in c["choices"][0] for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


async def test_chat_logprobs_shape():
    chunks = await _list(chat_chunks(_aiter([*_tokens("h", logprobs=True), _final()]), META,
                                     choices=1, logprobs=True, usage="none"))
    entry = chunks[1]["choices"][0]["logprobs"]["content"][0]
    assert entry == {"token": "h", "logprob": -1.0, "bytes": [104],
                     "top_logprobs": [{"token": "h", "logprob": -1.0, "bytes": [104]}]}


async def test_midstream_error_becomes_error_chunk_and_stops():
    events = [*_tokens("a"), ErrorEvent(kind="engine", message="boom"), *_tokens("b")]
    chunks = await _list(completion_chunks(_aiter(events), META, logprobs=False, usage="final"))
    assert chunks[-1] == {"error": {"message": "boom", "type": "InternalServerError",
                                    "param": None, "code": 500}}
    assert len(chunks) == 2


async def test_sse_framing_and_done():
    frames = await _list(sse(_aiter([{"a": 1}, {"b": "é"}])))
    # Compact JSON, UTF-8 as is (vLLM's and OpenAI's streams are compact too).
    assert frames == [b'data: {"a":1}\n\n', 'data: {"b":"é"}\n\n'.encode(), b"data: [DONE]\n\n"]
    json.loads(frames[1][len(b"data: "):])


async def test_with_echo_prefixes_each_choice_once():
    events = [PromptEvent(text="P:", tokens=()), *_tokens("a", 0), *_tokens("b", 1),
              *_tokens("c", 0), _final(0), _final(1)]
    out = await _list(with_echo(_aiter(events)))
    texts = [e.text for e in out if isinstance(e, TokenEvent)]
    assert texts == ["P:a", "P:b", "c"]


async def test_collect_folds_n_choices_and_counts_prompt_once_per_prompt():
    meta = ChunkMeta(id="x", created=1, model="m", n=2)
    events = [*_tokens("ab", 0), *_tokens("c", 1), _final(0, completion=2), _final(1, completion=1)]
    collected = await collect(_aiter(events), n=2)
    body = completion_response(collected, meta, logprobs=False)
    assert [c["text"] for c in body["choices"]] == ["ab", "c"]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0}}


def test_prompt_scores_list_the_prompt_token_then_the_top_k_as_vllm_does():
    top = (TopLogprob(token_id=7, text="a", logprob=-0.5), TopLogprob(token_id=9, text="y",
                                                                       logprob=-1.5),
           TopLogprob(token_id=3, text="c", logprob=-2.0))
    prompt = PromptEvent(text="xyz", tokens=(
        PromptToken(token_id=1, text="x"),
        PromptToken(token_id=9, text="y", logprob=-1.5, rank=2, top_logprobs=top),
        PromptToken(token_id=4, text="z", logprob=float("-inf"), rank=500, top_logprobs=top)))
    first, within, outside = prompt_scores(prompt, 2)
    assert first is None
    # The prompt token first; one of the top k keeps the rank it has there (as vLLM's dict).
    assert within == {"9": {"logprob": -1.5, "rank": 2, "decoded_token": "y"},
                      "7": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}
    assert list(outside) == ["4", "7", "9"]  # k=2 of the three alternatives the engine sent
    assert outside["4"] == {"logprob": -9999.0, "rank": 500, "decoded_token": "z"}  # JSON: no -inf
    json.dumps([first, within, outside], allow_nan=False)


async def test_tokens_a_mask_ruled_out_are_minus_9999_not_a_500():
    """Under a grammar (response_format) an engine's top logprobs include tokens its mask ruled
    out, at -inf, which JSON cannot carry: the whole response failed to encode (a 500, found by
    tests/e2e/test_pipeline_controllers_e2e.py). vLLM writes them -9999.0."""
    masked = TopLogprob(token_id=9, text="z", logprob=float("-inf"))
    token = TokenEvent(token_id=104, text="h", logprob=-0.5, token_text="h",
                       top_logprobs=(TopLogprob(token_id=104, text="h", logprob=-0.5), masked))
    chat = await _list(chat_chunks(_aiter([token, _final()]), META, choices=1, logprobs=True,
                                   usage="none"))
    tops = chat[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["logprob"] for t in tops] == [-0.5, -9999.0]
    plain = await _list(completion_chunks(_aiter([token, _final()]), META, logprobs=True,
                                          usage="none"))
    assert plain[0]["choices"][0]["logprobs"]["top_logprobs"] == [{"h": -0.5, "z": -9999.0}]
    whole = completion_response(await collect(_aiter([token, _final()]), 1), META,
                                logprobs=True)
    json.dumps(whole, allow_nan=False)  # what the response's encoder demands

"""LMTP framing, translation and item encoding (no server)."""

import math

import pytest

from contract import FinalEvent, PromptEvent, PromptToken, TokenEvent, TopLogprob, Usage
from protocols.lmtp.encode import generate_items, score_items
from protocols.lmtp.frames import FrameError, format_frame, parse_frame
from protocols.lmtp.translate import LMTPError, generate_request, score_request
from tests.streams import _aiter, _list


def test_parse_frame_splits_on_first_space():
    assert parse_frame('GENERATE {"a": "b c"}') == ("GENERATE", {"a": "b c"})


@pytest.mark.parametrize("text", ["GENERATE", "", " {}", "GENERATE [1]", "GENERATE {bad"])
def test_parse_frame_rejects_malformed(text):
    with pytest.raises(FrameError):
        parse_frame(text)


def test_parse_frame_salvages_stream_id_from_broken_json():
    with pytest.raises(FrameError) as info:
        parse_frame('GENERATE {"stream_id": 7, "prompt": [1,')
    assert info.value.stream_id == 7


def test_format_frame_is_compact_and_refuses_nan():
    assert format_frame("TOKEN", [{"a": 1}]) == 'TOKEN [{"a":1}]'
    with pytest.raises(ValueError):
        format_frame("TOKEN", [{"a": math.nan}])


def test_generate_defaults():
    req = generate_request({"model": "m", "prompt": [1, 2], "stream_id": 1}, "rid")
    assert req.sampling.max_tokens == 32 and req.sampling.temperature == 0
    assert req.output.logprobs == 1 and req.prompt.token_ids == (1, 2)


def test_generate_maps_bias_and_extras():
    req = generate_request({"model": "m", "prompt": [1], "stream_id": 1, "temperature": 1,
                            "logit_bias": {"5": 100, "6": -100.0}, "top_k": 3, "top_p": 0.9,
                            "top_logprobs": 4, "max_tokens": 2}, "rid")
    assert req.sampling.logit_bias == {5: 100.0, 6: -100.0}
    assert (req.sampling.top_k, req.sampling.top_p, req.sampling.temperature) == (3, 0.9, 1.0)
    assert req.output.logprobs == 4 and req.sampling.max_tokens == 2


@pytest.mark.parametrize(("payload", "message"), [
    ({"prompt": []}, "empty"),
    ({}, "missing field 'prompt'"),
    ({"prompt": [1, None]}, "integer"),
    ({"prompt": [1], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1], "max_tokens": -3}, "max_tokens"),
    ({"prompt": [1], "temperature": -1}, "temperature"),
    ({"prompt": [1], "length_penalty": 1.0}, "unsupported decoder argument 'length_penalty'"),
    ({"prompt": [1], "logit_bias": {"x": 1}}, "logit_bias"),
])
def test_generate_refusals(payload, message):
    with pytest.raises(LMTPError, match=message):
        generate_request({"model": "m", "stream_id": 1, **payload}, "rid")


def test_score_request_scores_the_appended_tokens():
    req, start, count = score_request({"model": "m", "prompt": [1, 2], "scored": [3, 4]}, "r")
    assert req.prompt.token_ids == (1, 2, 3, 4) and (start, count) == (2, 2)
    assert req.output.prompt_logprobs == 0 and req.sampling.temperature == 0
    with pytest.raises(LMTPError, match="scored"):
        score_request({"model": "m", "prompt": [1], "scored": []}, "r")


def _tok(token_id, logprob=-0.5, top=(), last=False):
    return TokenEvent(token_id=token_id, text="", logprob=logprob, top_logprobs=top, last=last)


def _final(reason):
    return FinalEvent(finish_reason=reason, usage=Usage(prompt_tokens=1, completion_tokens=2))


async def test_generate_items_exactly_once_with_finish_on_last():
    top = (TopLogprob(token_id=9, text="", logprob=-0.1), TopLogprob(token_id=5, text="",
                                                                     logprob=-0.5))
    items = await _list(generate_items(_aiter([_tok(5, top=top), _tok(2, last=True), _final("eos")]), 3))
    assert [i["token"] for i in items] == [5, 2]
    assert [i["finish_reason"] for i in items] == [None, "stop"]
    assert list(items[0]["top_logprobs"]) == ["5", "9"]  # chosen first, string keys
    assert all(i["stream_id"] == 3 for i in items)
    items = await _list(generate_items(_aiter([_tok(5), _tok(6, last=True), _final("length")]), 3))
    assert [i["finish_reason"] for i in items] == [None, "length"]


async def test_generate_items_never_send_non_finite():
    items = await _list(generate_items(_aiter([_tok(5, logprob=-math.inf, last=True), _final("length")]), 1))
    assert math.isfinite(items[0]["logprob"])


async def test_score_items_take_the_scored_slice():
    prompt = PromptEvent(text="", tokens=tuple(
        PromptToken(token_id=t, text="", logprob=None if i == 0 else -float(i))
        for i, t in enumerate([1, 2, 3, 4])))
    items = await _list(score_items(_aiter([prompt, _tok(7), _final("length")]), "s", 2, 2))
    assert items == [
        {"token": 3, "stream_id": "s", "logprob": -2.0, "finish_reason": None},
        {"token": 4, "stream_id": "s", "logprob": -3.0, "finish_reason": "stop"},
    ]
    first = await _list(score_items(_aiter([prompt]), 1, 0, 1))
    assert first[0]["logprob"] == 0.0  # no context: the reference reports 0.0


@pytest.mark.parametrize("body", ['{"stream_id": 2, "prompt": [' + "1" * 5000 + "]}",
                                  "[" * 100_000 + "]" * 100_000])
def test_parse_frame_survives_pathological_json(body):
    with pytest.raises(FrameError):
        parse_frame("GENERATE " + body)


async def test_generate_items_stream_tokens_without_waiting_for_the_next_one():
    async def events():
        yield _tok(5)
        yield _tok(6)
        raise AssertionError("the consumer must not need to look ahead")

    stream = generate_items(events(), 1)
    assert (await anext(stream))["token"] == 5
    assert (await anext(stream))["token"] == 6

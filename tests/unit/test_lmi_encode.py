"""LMI / TGI encoders: every response shape compared field by field with the seed's examples."""

import math

import pytest

from contract import (
    ErrorEvent,
    FinalEvent,
    PromptEvent,
    PromptToken,
    Timings,
    TokenEvent,
    TopLogprob,
    Usage,
)
from protocols.textgen.encode import (
    GenerationFailed,
    LMIWriter,
    ResponseMeta,
    TGIWriter,
    collect,
    dynamic_lines,
    jsonlines,
    response_body,
    sse,
    stream_objects,
)
from tests.seed_examples import LMI_SEED_STREAM_ERROR, LMI_SEED_STREAM_TOKENS
from tests.streams import _aiter, _list

INPUTS = "What is Deep Learning?"


def _seed_events(finish="length", extra_text=""):
    """The seed's jsonlines example as engine events: three tokens, then the final."""
    tokens = [TokenEvent(token_id=t["id"], text=t["text"], logprob=t["log_prob"],
                         last=i == len(LMI_SEED_STREAM_TOKENS) - 1)
              for i, t in enumerate(LMI_SEED_STREAM_TOKENS)]
    final = FinalEvent(finish_reason=finish, usage=Usage(prompt_tokens=6, completion_tokens=3),
                       timings=Timings(queue_s=0.001), text=extra_text)
    return [*tokens, final]


META = ResponseMeta(inputs=INPUTS, details=True)


async def test_lmi_jsonlines_matches_the_seed_example():
    lines = await _list(stream_objects(_aiter(_seed_events()), META, LMIWriter()))
    assert lines[:2] == [{"token": t} for t in LMI_SEED_STREAM_TOKENS[:2]]
    assert lines[2] == {
        "token": LMI_SEED_STREAM_TOKENS[2],
        "generated_text": "Deep  Learning is",
        "details": {"finish_reason": "length", "generated_tokens": 3, "inputs": INPUTS},
    }
    assert list(lines[2]) == ["token", "generated_text", "details"]  # the seed's field order


async def test_lmi_stream_without_details_has_no_details_key():
    meta = ResponseMeta(inputs=INPUTS, details=False)
    lines = await _list(stream_objects(_aiter(_seed_events()), meta, LMIWriter()))
    assert set(lines[-1]) == {"token", "generated_text"}


async def test_jsonlines_and_sse_framing():
    lines = stream_objects(_aiter(_seed_events()), META, LMIWriter())
    raw = b"".join(await _list(jsonlines(lines))).decode()
    assert raw.count("\n") == 3 and raw.endswith("}\n") and "data:" not in raw
    lines = stream_objects(_aiter(_seed_events()), META, LMIWriter())
    raw = b"".join(await _list(sse(lines, space=True))).decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and all(f.startswith('data: {"token"') for f in frames[:-1])
    lines = stream_objects(_aiter(_seed_events()), META, TGIWriter())
    raw = b"".join(await _list(sse(lines, space=False))).decode()
    assert all(f.startswith('data:{"index"') for f in raw.split("\n\n")[:-1])
    assert "[DONE]" not in raw and "\n:" not in raw


async def test_lmi_stream_error_line_is_the_seed_shape_plus_error_msg():
    events = [*_seed_events()[:1], ErrorEvent(kind="engine", message="boom")]
    lines = await _list(stream_objects(_aiter(events), META, LMIWriter()))
    expected = {**LMI_SEED_STREAM_ERROR,
                "token": {**LMI_SEED_STREAM_ERROR["token"], "error_msg": "boom"}}
    assert lines == [{"token": LMI_SEED_STREAM_TOKENS[0]}, expected]


async def test_abort_mid_stream_is_an_error_line():
    events = [*_seed_events()[:2], FinalEvent(finish_reason="abort", stop_reason="timeout",
                                              usage=Usage(prompt_tokens=1, completion_tokens=2))]
    lines = await _list(stream_objects(_aiter(events), META, LMIWriter()))
    assert lines[-1]["details"]["finish_reason"] == "error"
    assert "timed out" in lines[-1]["token"]["error_msg"]
    tgi = await _list(stream_objects(_aiter(events), META, TGIWriter()))
    assert tgi[-1] == {"error": "generation timed out before it finished",
                       "error_type": "generation"}


async def test_text_flushed_at_the_end_joins_the_last_token():
    lines = await _list(stream_objects(_aiter(_seed_events(extra_text="!")), META, LMIWriter()))
    assert lines[-1]["token"]["text"] == " is!" and lines[-1]["generated_text"].endswith("is!")


async def test_return_full_text_prefixes_the_prompt():
    meta = ResponseMeta(inputs="Q:", details=False, return_full_text=True)
    lines = await _list(stream_objects(_aiter(_seed_events()), meta, LMIWriter()))
    assert lines[-1]["generated_text"] == "Q:Deep  Learning is"
    _, seqs = await collect(_aiter(_seed_events()))
    assert response_body(None, seqs, meta, LMIWriter()) == {"generated_text": "Q:Deep  Learning is"}


async def test_lmi_non_stream_body_matches_the_seed():
    prompt, seqs = await collect(_aiter(_seed_events()))
    body = response_body(prompt, seqs, META, LMIWriter())
    assert body == {"generated_text": "Deep  Learning is",
                    "details": {"finish_reason": "length", "generated_tokens": 3, "inputs": INPUTS,
                                "tokens": LMI_SEED_STREAM_TOKENS}}
    assert list(body["details"]) == ["finish_reason", "generated_tokens", "inputs", "tokens"]
    assert response_body(prompt, seqs, ResponseMeta(inputs=INPUTS, details=False),
                         LMIWriter()) == {"generated_text": "Deep  Learning is"}


@pytest.mark.parametrize("finish, stop_reason, expected", [
    ("eos", None, "eos_token"), ("stop_sequence", "\n", "stop_sequence"),
    ("length", None, "length")])
async def test_finish_reasons(finish, stop_reason, expected):
    events = _seed_events()
    events[-1] = FinalEvent(finish_reason=finish, stop_reason=stop_reason,
                            usage=Usage(prompt_tokens=6, completion_tokens=3))
    prompt, seqs = await collect(_aiter(events))
    assert response_body(prompt, seqs, META, LMIWriter())["details"]["finish_reason"] == expected


def _prompt_event():
    return PromptEvent(text="Hi you", tokens=(PromptToken(token_id=1, text="Hi"),
                                              PromptToken(token_id=2, text=" you", logprob=-2.5)))


async def test_prefill_lmi_and_tgi():
    meta = ResponseMeta(inputs="Hi you", details=True, prefill=True)
    prompt, seqs = await collect(_aiter([_prompt_event(), *_seed_events()]))
    lmi = response_body(prompt, seqs, meta, LMIWriter())["details"]["prefill"]
    assert lmi == [{"id": 1, "text": "Hi", "log_prob": None},
                   {"id": 2, "text": " you", "log_prob": -2.5}]
    tgi = response_body(prompt, seqs, meta, TGIWriter())["details"]["prefill"]
    assert tgi == [{"id": 1, "text": "Hi", "logprob": None},
                   {"id": 2, "text": " you", "logprob": -2.5}]


async def test_tgi_generate_response_shape():
    meta = ResponseMeta(inputs=INPUTS, details=True, seed=42)
    prompt, seqs = await collect(_aiter(_seed_events(finish="eos")))
    body = response_body(prompt, seqs, meta, TGIWriter())
    tokens = [{"id": t["id"], "text": t["text"], "logprob": t["log_prob"], "special": False}
              for t in LMI_SEED_STREAM_TOKENS]
    assert body == {"generated_text": "Deep  Learning is",
                    "details": {"finish_reason": "eos_token", "generated_tokens": 3, "seed": 42,
                                "prefill": [], "tokens": tokens}}
    compat = response_body(prompt, seqs, meta, TGIWriter(with_inputs=True))
    assert compat["details"]["inputs"] == INPUTS


async def test_tgi_stream_response_shape():
    meta = ResponseMeta(inputs=INPUTS, details=True, seed=None)
    events = await _list(stream_objects(_aiter(_seed_events()), meta, TGIWriter()))
    assert events[0] == {"index": 0, "token": {"id": 304, "text": "Deep ",
                                               "logprob": -0.052432529628276825, "special": False},
                         "generated_text": None, "details": None}
    assert [e["index"] for e in events] == [0, 1, 2]
    assert events[-1]["generated_text"] == "Deep  Learning is"
    assert events[-1]["details"] == {"finish_reason": "length", "generated_tokens": 3,
                                     "seed": None, "input_length": 6}


async def test_special_tokens():
    eos = TokenEvent(token_id=2, text="", logprob=-0.5, special=True, token_text="<|im_end|>",
                     last=True)
    events = [TokenEvent(token_id=9, text="Hi", logprob=-0.1), eos,
              FinalEvent(finish_reason="eos", usage=Usage(prompt_tokens=1, completion_tokens=2))]
    lmi = await _list(stream_objects(_aiter(events), META, LMIWriter()))
    assert "special_token" not in lmi[0]["token"]  # LMI writes the key only when true
    assert lmi[1]["token"] == {"id": 2, "text": "<|im_end|>", "log_prob": -0.5,
                               "special_token": True}
    assert lmi[1]["generated_text"] == "Hi"  # special tokens are not part of the text
    tgi = await _list(stream_objects(_aiter(events), META, TGIWriter()))
    assert tgi[0]["token"]["special"] is False and tgi[1]["token"]["special"] is True


async def test_top_tokens():
    top = (TopLogprob(token_id=5, text="a", logprob=-0.1), TopLogprob(token_id=0, text="", logprob=-3))
    events = [TokenEvent(token_id=5, text="a", logprob=-0.1, top_logprobs=top, last=True),
              FinalEvent(finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1))]
    meta = ResponseMeta(inputs="x", details=True, top_n_tokens=2, eos_token_id=0)
    _, seqs = await collect(_aiter(events))
    tgi = response_body(None, seqs, meta, TGIWriter())["details"]["top_tokens"]
    assert tgi == [[{"id": 5, "text": "a", "logprob": -0.1, "special": False},
                    {"id": 0, "text": "", "logprob": -3, "special": True}]]
    stream = await _list(stream_objects(_aiter(events), meta, TGIWriter()))
    assert stream[0]["top_tokens"] == tgi[0]


async def test_best_of_picks_the_most_likely_sequence():
    def seq(index, logprobs, text):
        toks = [TokenEvent(index=index, token_id=10 + i, text=c, logprob=lp,
                           last=i == len(logprobs) - 1)
                for i, (c, lp) in enumerate(zip(text, logprobs, strict=True))]
        return [*toks, FinalEvent(index=index, finish_reason="length",
                                  usage=Usage(prompt_tokens=1, completion_tokens=len(text)))]

    events = [*seq(0, [-1.0, -2.0], "ab"), *seq(1, [-0.1, -0.2], "cd"), *seq(2, [-5.0, -5.0], "ef")]
    _, seqs = await collect(_aiter(events))
    body = response_body(None, seqs, META, LMIWriter())
    assert body["generated_text"] == "cd"
    others = body["details"]["best_of_sequences"]
    assert [o["generated_text"] for o in others] == ["ab", "ef"]
    assert set(others[0]) == {"generated_text", "finish_reason", "generated_tokens", "tokens"}
    tgi = response_body(None, seqs, ResponseMeta(inputs="x", details=True, seed=1), TGIWriter())
    assert set(tgi["details"]["best_of_sequences"][0]) == {
        "generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"}


async def test_collect_raises_on_errors_and_aborts():
    with pytest.raises(GenerationFailed) as info:
        await collect(_aiter([ErrorEvent(kind="validation", message="bad")]))
    assert info.value.event.kind == "validation"
    aborted = [FinalEvent(finish_reason="abort", usage=Usage(prompt_tokens=1, completion_tokens=0))]
    with pytest.raises(GenerationFailed):
        await collect(_aiter(aborted))


async def test_non_finite_logprobs_are_null():
    events = [TokenEvent(token_id=1, text="a", logprob=-math.inf, last=True),
              FinalEvent(finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1))]
    _, seqs = await collect(_aiter(events))
    assert response_body(None, seqs, META, LMIWriter())["details"]["tokens"][0]["log_prob"] is None


async def test_dynamic_lines_step_in_lockstep_and_pad_finished_inputs():
    def stream(text):
        toks = [TokenEvent(token_id=i, text=c, last=i == len(text) - 1) for i, c in enumerate(text)]
        return _aiter([*toks, FinalEvent(finish_reason="eos",
                                         usage=Usage(prompt_tokens=1, completion_tokens=len(text)))])

    lines = await _list(dynamic_lines([stream("abc"), stream("x")]))
    assert lines == [{"outputs": ["a", "x"]}, {"outputs": ["b", ""]}, {"outputs": ["c", ""]}]


async def test_dynamic_lines_raise_on_failure():
    failing = _aiter([TokenEvent(token_id=1, text="a"), ErrorEvent(kind="engine", message="x")])
    with pytest.raises(GenerationFailed):
        await _list(dynamic_lines([failing]))


async def test_pieces_give_token_texts_when_stop_strings_hold_text_back():
    # vLLM's deltas lag behind the tokens when stop strings are set: " Paris." arrives as
    # "" then " Paris" while the tokens are " Paris" and "."; `piece` carries each token's text.
    events = [TokenEvent(token_id=1, text="", piece=" Paris"),
              TokenEvent(token_id=2, text=" Paris", piece=".", last=True),
              FinalEvent(finish_reason="length", text=".",
                         usage=Usage(prompt_tokens=1, completion_tokens=2))]
    lines = await _list(stream_objects(_aiter(events), META, LMIWriter()))
    assert [line["token"]["text"] for line in lines] == [" Paris", "."]
    assert lines[-1]["generated_text"] == " Paris."
    _, seqs = await collect(_aiter(events))
    body = response_body(None, seqs, META, TGIWriter())
    assert [t["text"] for t in body["details"]["tokens"]] == [" Paris", "."]
    assert body["generated_text"] == " Paris."

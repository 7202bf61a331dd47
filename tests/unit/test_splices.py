"""Splices (forced tokens, backtracks, forks) in every encoder: whole responses apply them,
streams (which can only grow) render what came before and end with an error in their own shape."""

import pytest

from contract import (
    BacktrackEvent,
    ErrorEvent,
    FinalEvent,
    ForkEvent,
    PromptEvent,
    TokenEvent,
    Usage,
    splice_refusal,
)
from protocols.lmtp.encode import generate_items
from protocols.mindie.encode import ResponseMeta as MindIEMeta
from protocols.mindie.encode import collect_response, stream_events
from protocols.openai.encode import (
    ChunkMeta,
    chat_chunks,
    chat_response,
    collect,
    completion_chunks,
    completion_response,
)
from protocols.streams import fold_splices, reindexed
from protocols.textgen.encode import GenerationFailed, LMIWriter, TGIWriter, dynamic_lines, stream_objects
from protocols.textgen.encode import ResponseMeta as TextgenMeta
from protocols.textgen.encode import collect as textgen_collect
from tests.streams import _aiter, _list

META = ChunkMeta(id="cmpl-1", created=1, model="m")


def _t(text, index=0, forced=False):
    return TokenEvent(index=index, token_id=ord(text), text=text, token_text=text, forced=forced,
                      logprob=None if forced else -0.5)


def _final(index=0, completion=4):
    return FinalEvent(index=index, finish_reason="length",
                      usage=Usage(prompt_tokens=3, completion_tokens=completion, forced_tokens=2))


BACKTRACK = BacktrackEvent(index=0, count=2, text="el")
FORK = ForkEvent(index=1, parent=0)
# forced "ab", sampled "Hel", "el" withdrawn, "!" sampled, then choice 1 forks off choice 0.
SCRIPT = [_t("a", forced=True), _t("b", forced=True), _t("H"), _t("e"), _t("l"), BACKTRACK, _t("!"),
          FORK, _final(0), _final(1)]
# What every stream encoder sees: two forced tokens, one sampled, then a splice it cannot show.
SPLICES = pytest.mark.parametrize("splice", [BACKTRACK, FORK], ids=["backtrack", "fork"])


def _stream_script(splice):
    return [_t("a", forced=True), _t("b", forced=True), _t("H"), splice, _t("!"), _final(0)]


def _texts_by_choice(events):
    out = {}
    for e in events:
        if isinstance(e, TokenEvent):
            out[e.index] = out.get(e.index, "") + e.text
    return out


# --- fold_splices / reindexed -----------------------------------------------------------------


async def test_fold_applies_backtracks_and_copies_forks():
    """Withdrawn tokens never appear; a fork carries the parent's tokens at fork time, re-indexed."""
    out = await _list(fold_splices(_aiter(SCRIPT)))
    assert not any(isinstance(e, (BacktrackEvent, ForkEvent)) for e in out)
    assert _texts_by_choice(out) == {0: "abH!", 1: "abH!"}
    fork_tokens = [e for e in out if isinstance(e, TokenEvent) and e.index == 1]
    assert [t.forced for t in fork_tokens] == [True, True, False, False]
    assert [e.index for e in out if isinstance(e, FinalEvent)] == [0, 1]


async def test_fold_fork_and_parent_diverge_independently():
    """After a fork, later tokens and backtracks of one choice do not touch the other."""
    events = [_t("a"), _t("b"), FORK, _t("c", 0), BacktrackEvent(index=1, count=1, text="b"),
              _t("y", 1), _final(1), _final(0)]
    out = await _list(fold_splices(_aiter(events)))
    assert _texts_by_choice(out) == {0: "abc", 1: "ay"}


async def test_fold_holds_tokens_per_choice_until_its_final():
    """Each choice's tokens come out together, right before its FinalEvent (append-only)."""
    f0, f1 = _final(0), _final(1)
    out = await _list(fold_splices(_aiter([_t("a", 0), _t("b", 1), f1, _t("c", 0), f0])))
    assert out == [_t("b", 1), f1, _t("a", 0), _t("c", 0), f0]


async def test_fold_backtrack_beyond_held_tokens_does_not_crash():
    """Withdrawing more tokens than a choice holds (or from a choice holding none) empties it."""
    events = [BacktrackEvent(index=2, count=1), _t("a"), BacktrackEvent(index=0, count=5, text="a"),
              _t("b"), _final(0)]
    out = await _list(fold_splices(_aiter(events)))
    assert out == [_t("b"), _final(0)]


async def test_fold_broken_off_stream_still_yields_held_tokens():
    """A stream that ends without finals still yields what was generated (forks included)."""
    out = await _list(fold_splices(_aiter([_t("a"), _t("b"), FORK, _t("c", 1), _t("d", 0)])))
    assert _texts_by_choice(out) == {0: "abd", 1: "abc"}
    assert all(isinstance(e, TokenEvent) for e in out)


async def test_fold_passes_prompt_and_error_through_in_order():
    """Prompt first; a finished choice before the error; the error ends the folded stream."""
    prompt = PromptEvent(text="P", tokens=())
    error = ErrorEvent(kind="engine", message="boom")
    out = await _list(fold_splices(_aiter([prompt, _t("a", 0), _final(0), _t("b", 1), error])))
    assert out[0] == prompt
    assert out[1:3] == [_t("a", 0), _final(0)]
    assert out[-1] == error and out.count(error) == 1


async def test_reindexed_shifts_splice_events():
    """Backtrack indices and both fork indices move by ``base``; other fields are kept."""
    events = [BacktrackEvent(index=0, count=2, text="el"), ForkEvent(index=1, parent=0)]
    out = await _list(reindexed(_aiter(events), base=4))
    assert out == [BacktrackEvent(index=4, count=2, text="el"), ForkEvent(index=5, parent=4)]
    assert await _list(reindexed(_aiter(events), base=0)) == events


# --- whole responses --------------------------------------------------------------------------


async def test_openai_whole_responses_apply_splices_and_list_forks():
    """Completion and chat bodies: backtrack applied, the fork is an extra choice with its index."""
    collected = await collect(_aiter(SCRIPT), n=1)
    body = completion_response(collected, META, logprobs=True)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "abH!"), (1, "abH!")]
    assert body["choices"][0]["logprobs"]["tokens"] == ["a", "b", "H", "!"]
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 1, 2, 3]
    chat = chat_response(await collect(_aiter(SCRIPT), n=1), META, logprobs=False)
    assert [(c["index"], c["message"]["content"]) for c in chat["choices"]] == [(0, "abH!"),
                                                                                  (1, "abH!")]


async def test_openai_usage_counts_returned_tokens_and_the_prompt_once():
    """Usage: completion tokens as finally returned (4 + 4 inherited); one prompt, counted once."""
    body = completion_response(await collect(_aiter(SCRIPT), n=1), META, logprobs=False)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0}}


async def test_textgen_collect_makes_forks_extra_sequences():
    """LMI/TGI whole responses: backtrack applied, one SequenceResult per choice, fork included."""
    _, seqs = await textgen_collect(_aiter(SCRIPT))
    assert [(s.index, s.text) for s in seqs] == [(0, "abH!"), (1, "abH!")]
    assert [t.text for t in seqs[1].tokens] == ["a", "b", "H", "!"]


async def test_mindie_collect_applies_backtracks_and_reports_choice_zero():
    """MindIE body: the backtracked text of choice 0; a diverging fork does not leak into it."""
    events = [*SCRIPT[:-2], _t("?", 1), _final(0), _final(1, completion=5)]
    body = await collect_response(_aiter(events), MindIEMeta("a", "m", True))
    assert body["text_output"] == "abH!"
    assert body["details"]["generated_tokens"] == 4


# --- streams: render what came before, then end with an error ---------------------------------


@SPLICES
async def test_openai_completion_stream_ends_with_error_chunk(splice):
    """Forced tokens stream like any token; the splice becomes the final error envelope chunk."""
    chunks = await _list(completion_chunks(_aiter(_stream_script(splice)), META, logprobs=True,
                                           usage="final"))
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["a", "b", "H"]
    assert set(chunks[-1]) == {"error"}
    assert chunks[-1]["error"]["message"] == splice_refusal(splice).message
    assert chunks[-1]["error"]["param"] == "controller"


@SPLICES
async def test_openai_chat_stream_ends_with_error_chunk(splice):
    """Chat: role chunk, one content chunk per token before the splice, then the error chunk."""
    chunks = await _list(chat_chunks(_aiter(_stream_script(splice)), META, choices=1, logprobs=True,
                                     usage="final"))
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]] == ["a", "b", "H"]
    assert chunks[-1] == {"error": {**chunks[-1]["error"], "message": splice_refusal(splice).message}}


@SPLICES
@pytest.mark.parametrize("writer", [LMIWriter(), TGIWriter()], ids=["lmi", "tgi"])
async def test_textgen_stream_ends_with_the_writers_error(splice, writer):
    """LMI/TGI streams: a line per token before the splice, then the writer's stream_error."""
    lines = await _list(stream_objects(_aiter(_stream_script(splice)),
                                       TextgenMeta(inputs="x", details=True), writer))
    assert [line["token"]["text"] for line in lines[:-1]] == ["a", "b", "H"]
    assert lines[-1] == writer.stream_error(splice_refusal(splice).message)


@SPLICES
async def test_dynamic_lines_raise_on_a_splice(splice):
    """Dynamic batching raises GenerationFailed carrying the refusal, after at most 'abH'."""
    lines = []
    with pytest.raises(GenerationFailed) as info:
        async for line in dynamic_lines([_aiter(_stream_script(splice))]):
            lines.append(line)
    assert info.value.event.message == splice_refusal(splice).message
    assert "abH".startswith("".join(line["outputs"][0] for line in lines))


@SPLICES
async def test_mindie_stream_ends_with_generation_error(splice):
    """MindIE streams: a text_output per token before the splice, then its error object."""
    out = await _list(stream_events(_aiter(_stream_script(splice)), MindIEMeta("a", "m", False)))
    assert [e["text_output"] for e in out[:-1]] == ["a", "b", "H"]
    assert out[-1] == {"error": splice_refusal(splice).message, "error_type": "Generation Error"}


@SPLICES
async def test_lmtp_generate_ends_with_error_item(splice):
    """LMTP: an item per token (a forced token's logprob is 0.0), then {stream_id, error}."""
    items = await _list(generate_items(_aiter(_stream_script(splice)), 7))
    assert [i["token"] for i in items[:-1]] == [ord("a"), ord("b"), ord("H")]
    assert [i["logprob"] for i in items[:-1]] == [0.0, 0.0, -0.5]
    assert items[-1] == {"stream_id": 7, "error": splice_refusal(splice).message}

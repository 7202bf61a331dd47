"""The pipeline engine kind behind the real EngineHost, with in-process stages (no Ray): the
stream contract, sampling options, stops, and cache hygiene on every way a request ends.
Oracle for greedy output: the unsplit HF model (``reference_greedy``: ``generate``)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
import torch

from contract import (
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    OutputOptions,
    PromptEvent,
    Sampling,
    TextPrompt,
    TokenEvent,
)
from engines.kit.config import ModelConfig
from engines.pipeline.config import PipelineArgs, plan_stages
from engines.pipeline.engine import PipelineEngine
from engines.pipeline.loading import load_layers
from engines.pipeline.sampling import Sampler
from engines.pipeline.stage import CacheMismatch, StageCore
from engines.pipeline.stages import LocalStages, Resolved
from engines.pipeline.text import OutputText
from engines.replica.host import EngineHost
from tests.pipeline_models import local_pipeline

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(tiny_dir) -> PipelineEngine:
    return local_pipeline(tiny_dir, prefill_chunk=3)


def _req(rid: str, **sampling) -> GenerateRequest:
    output = sampling.pop("output", OutputOptions())
    sampling.setdefault("temperature", 0)
    sampling.setdefault("max_tokens", 8)
    return GenerateRequest(request_id=rid, model="tiny", prompt=TextPrompt(text=PROMPT),
                           sampling=Sampling(**sampling), output=output)


async def _events(engine, request):
    return [e async for e in EngineHost(engine).generate(request)]


def _clean(engine: PipelineEngine) -> bool:
    stages = engine.stages
    assert isinstance(stages, LocalStages)
    return all(c.cached() == {} for c in stages.cores) and engine.origin.own.cached() == {}


async def test_greedy_equals_the_unsplit_generate(engine):
    events = await _events(engine, _req("g", max_tokens=10, output=OutputOptions(logprobs=3)))
    reference = await engine.reference_greedy(PROMPT, 10)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [t.token_id for t in tokens] == reference.token_ids
    assert "".join(t.text for t in tokens) + events[-1].text == reference.text
    for token, logprob in zip(tokens, reference.logprobs, strict=True):
        assert token.logprob == pytest.approx(logprob, abs=1e-4)
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].logprob >= token.logprob - 1e-6
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.finish_reason == "length"
    assert final.usage.completion_tokens == 10 and tokens[-1].last
    assert _clean(engine)


async def test_prompt_logprobs_match_the_unsplit_forward(engine, tiny_dir):
    from transformers import AutoModelForCausalLM

    events = await _events(engine, _req("p", max_tokens=1,
                                        output=OutputOptions(prompt_logprobs=2, echo=True)))
    prompt = events[0]
    assert isinstance(prompt, PromptEvent) and prompt.text == PROMPT
    ids = [t.token_id for t in prompt.tokens]
    assert ids == engine.tokenizer.encode(PROMPT)  # every position, none lost
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    assert prompt.tokens[0].logprob is None
    for i, token in enumerate(prompt.tokens[1:], start=1):
        assert token.logprob == pytest.approx(float(logprobs[i - 1, ids[i]]), abs=1e-4)
        assert len(token.top_logprobs) == 2
        # Its rank among the unsplit model's candidates, up to those within the tolerance.
        row, own = logprobs[i - 1], float(logprobs[i - 1, ids[i]])
        assert int((row > own + 1e-4).sum()) < token.rank <= int((row > own - 1e-4).sum())


async def test_n_choices_with_a_seed_are_reproducible_and_follow_the_contract(engine):
    request = _req("n", n=3, temperature=1.0, seed=11, max_tokens=6,
                   output=OutputOptions(echo=True))
    first, second = await _events(engine, request), await _events(engine, request)
    assert isinstance(first[0], PromptEvent)
    by_choice = {i: [e.token_id for e in first if isinstance(e, TokenEvent) and e.index == i]
                 for i in range(3)}
    assert all(len(v) == 6 for v in by_choice.values())
    assert len({tuple(v) for v in by_choice.values()}) > 1  # choices draw differently
    again = {i: [e.token_id for e in second if isinstance(e, TokenEvent) and e.index == i]
             for i in range(3)}
    assert by_choice == again
    assert sorted(e.index for e in first if isinstance(e, FinalEvent)) == [0, 1, 2]
    assert _clean(engine)


async def test_stop_strings_cut_the_text_and_hold_nothing_back(engine):
    plain = await _events(engine, _req("s0", max_tokens=12))
    text = "".join(e.text for e in plain if isinstance(e, TokenEvent)) + plain[-1].text
    stop = text[3:6]
    events = await _events(engine, _req("s1", max_tokens=12, stop=(stop,)))
    final = events[-1]
    assert final.finish_reason == "stop_sequence" and final.stop_reason == stop
    out = "".join(e.text for e in events if isinstance(e, TokenEvent)) + final.text
    assert out == text[: text.index(stop)]


async def test_logit_bias_min_tokens_and_stop_token_ids(engine):
    forced = (await _events(engine, _req("b", max_tokens=4, logit_bias={1000: 100.0})))
    assert [e.token_id for e in forced if isinstance(e, TokenEvent)] == [1000] * 4
    plain = [e.token_id for e in await _events(engine, _req("t0", max_tokens=5))
             if isinstance(e, TokenEvent)]
    stopped = await _events(engine, _req("t1", max_tokens=5, stop_token_ids=(plain[2],)))
    assert [e.token_id for e in stopped if isinstance(e, TokenEvent)] == plain[:3]
    assert stopped[-1].finish_reason == "stop_sequence" and stopped[-1].stop_reason == plain[2]
    held = await _events(engine, _req("t2", max_tokens=5, min_tokens=5,
                                      stop_token_ids=(plain[2],)))
    assert held[-1].finish_reason == "length"


async def test_a_disconnect_frees_every_cache(engine):
    stream = EngineHost(engine).generate(_req("d", max_tokens=50))
    async with aclosing(stream):
        async for event in stream:
            if isinstance(event, TokenEvent):
                assert not _clean(engine)  # the sequence is live in every stage
                break
    assert _clean(engine)


async def test_restarts_are_capped_then_the_request_fails_cleanly(engine):
    class Broken(LocalStages):
        def submit(self, hop, check):
            return Resolved(error=CacheMismatch("stage lost"))

    working, engine.origin.stages = engine.origin.stages, Broken(engine.origin.stages.cores)
    try:
        events = await _events(engine, _req("f"))
    finally:
        engine.origin.stages = working
    assert len(events) == 1 and isinstance(events[0], ErrorEvent)
    assert events[0].kind == "engine" and "failed 3 times" in events[0].message
    assert _clean(engine)


async def test_deadline_frees_caches(engine):
    request = _req("dl", max_tokens=400, ignore_eos=True).__replace__(timeout_s=0.05)
    events = await _events(engine, request)
    assert events[-1].finish_reason == "abort"
    await asyncio.sleep(0)
    assert _clean(engine)


def test_sampler_follows_the_knobs():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    greedy = Sampler(Sampling(temperature=0), [], frozenset(), 4)
    assert greedy.sample(logits, None)[0] == 1
    top1 = Sampler(Sampling(temperature=1.0, top_k=1, seed=0), [], frozenset(), 4)
    assert {top1.sample(logits, None)[0] for _ in range(20)} == {1}
    nucleus = Sampler(Sampling(temperature=1.0, top_p=0.5, seed=0), [], frozenset(), 4)
    assert {nucleus.sample(logits, None)[0] for _ in range(20)} == {1}
    min_p = Sampler(Sampling(temperature=1.0, min_p=0.5, seed=0), [], frozenset(), 4)
    assert {min_p.sample(logits, None)[0] for _ in range(50)} <= {1, 2}
    blocked = Sampler(Sampling(temperature=0, min_tokens=1), [], frozenset({1}), 4)
    assert blocked.sample(logits, None)[0] == 2  # EOS (1) is held back for min_tokens
    assert blocked.sample(logits, None)[0] == 1
    repeat = Sampler(Sampling(temperature=0, repetition_penalty=2.0), [1], frozenset(), 4)
    assert repeat.sample(logits, None)[0] == 2  # 3/2 < 2
    _, lp = Sampler(Sampling(temperature=0, logit_bias={3: 50.0}), [], frozenset(), 4).sample(
        logits, 2)
    assert lp is not None and lp.top[0][0] == 1  # logprobs are the raw model's, not biased
    seeded = [Sampler(Sampling(temperature=1.0, seed=5), [], frozenset(), 4) for _ in range(2)]
    assert [seeded[0].sample(logits, None)[0] for _ in range(10)] == [
        seeded[1].sample(logits, None)[0] for _ in range(10)]


def test_output_text_holds_back_a_possible_stop_string():
    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    text = OutputText(Chars(), [], True, ("END",), include_stop=False)
    deltas = [text.add(ord(c)) for c in "abENxEND"]
    assert "".join(d for _, d, _ in deltas) == "abENx"
    # Two characters (a stop string's length - 1) stay back until they can't start one.
    assert [d for _, d, _ in deltas] == ["", "", "a", "b", "E", "N", "x", ""]
    assert deltas[-1][2] == "END" and text.flush() == ""
    kept = OutputText(Chars(), [], True, ("END",), include_stop=True)
    assert "".join(kept.add(ord(c))[1] for c in "xEND") == "xEND"


@pytest.mark.parametrize(("args", "message"), [
    ({"stages": [[1, 10], [9, 30]]}, "overlaps"),
    ({"stages": [[1, 10], [11, 30]]}, "gap"),
    ({"stages": [[1, 10], [10, 31]]}, "exceed"),
    ({"stages": [[1, 10], [10, 20]]}, "do not cover"),
    ({"stages": [[0, 30]]}, "must start at layer 1"),
    ({"num_stages": 40}, "40 stages for 29 layers"),
    ({"stage_resources": [{"a": 1}]}, "1 entries for 2 stages"),
    ({"prefill_chunk": 0}, "prefill_chunk"),
    ({"layers": 3}, "unknown field"),
])
def test_bad_layer_plans_fail_at_config_load(args, message):
    from engines.kit.embedded import prepare_embedded_model

    prepare_embedded_model(progress=False)  # readable here, so coverage is checked too
    with pytest.raises(ValueError, match=message):
        ModelConfig(name="p", engine="pipeline", engine_args=args)


def test_even_split():
    assert plan_stages(PipelineArgs(num_stages=3), 30) == [(1, 11), (11, 21), (21, 30)]
    assert plan_stages(PipelineArgs(origin_layers=0, num_stages=2), 5) == [(0, 3), (3, 5)]


async def test_a_hung_stage_times_out_into_the_restart_path(engine):
    class Never:  # a stage call that never answers
        def __await__(self):
            return asyncio.sleep(3600).__await__()

    class Hung(LocalStages):
        def submit(self, hop, check):
            return Never()

    working, timeout = engine.origin.stages, engine.origin.step_timeout_s
    engine.origin.stages, engine.origin.step_timeout_s = Hung(working.cores), 0.05
    try:
        events = await _events(engine, _req("hung"))
    finally:
        engine.origin.stages, engine.origin.step_timeout_s = working, timeout
    assert len(events) == 1 and isinstance(events[0], ErrorEvent)
    assert "StageTimeout" in events[0].message


def test_the_device_option_smoke_on_cpu(tiny_dir):
    """``device`` named explicitly takes the ``.to(device)`` path; only ``cpu`` can run here (no
    GPU), so this is a smoke test of that path, not a check of CUDA placement."""
    config = ModelConfig(name="tiny", engine="pipeline", source=str(tiny_dir),
                         engine_args={"stages": [[1, 6]], "device": "cpu"})
    cores = [StageCore(load_layers(tiny_dir, 1, 6), 1, 6, device="cpu")]
    engine = PipelineEngine(config, stages=LocalStages(cores))
    assert engine.origin.device == "cpu" and engine.origin.parts.embed.weight.device.type == "cpu"
    events = asyncio.run(_events(engine, _req("dev", max_tokens=3)))
    assert [type(e).__name__ for e in events][-1] == "FinalEvent"


async def test_a_restart_during_a_prompt_logprobs_prefill_still_reports_every_position(engine):
    expected = await _events(engine, _req("pl0", max_tokens=2,
                                          output=OutputOptions(prompt_logprobs=1)))
    calls = 0
    working = engine.origin.stages

    class FailFirst(LocalStages):
        def submit(self, hop, check):
            nonlocal calls
            calls += 1
            if calls == 1:  # the first prefill chunk is lost
                return Resolved(error=CacheMismatch("lost"))
            return super().submit(hop, check)

    engine.origin.stages = FailFirst(working.cores)
    try:
        got = await _events(engine, _req("pl1", max_tokens=2,
                                         output=OutputOptions(prompt_logprobs=1)))
    finally:
        engine.origin.stages = working
    assert calls > 2 and isinstance(got[0], PromptEvent)
    assert got[0].tokens == expected[0].tokens
    assert [e.token_id for e in got if isinstance(e, TokenEvent)] == [
        e.token_id for e in expected if isinstance(e, TokenEvent)]
    assert _clean(engine)


async def test_closing_an_n_choice_stream_ends_every_choice_and_frees_caches(engine):
    request = _req("nclose", n=3, temperature=1.0, seed=3, max_tokens=300, ignore_eos=True)
    stream = EngineHost(engine).generate(request)
    async with asyncio.timeout(30):  # a stuck task would hang here
        async with aclosing(stream):
            seen = 0
            async for event in stream:
                seen += isinstance(event, TokenEvent)
                if seen == 5:
                    break
    assert engine.live == 0 and _clean(engine)


async def test_stop_strings_wait_for_min_tokens(engine):
    plain = await _events(engine, _req("m0", max_tokens=12))
    text = "".join(e.text for e in plain if isinstance(e, TokenEvent)) + plain[-1].text
    pieces = [e for e in plain if isinstance(e, TokenEvent)]
    stop = text[1:3]  # inside the first tokens' text
    early = await _events(engine, _req("m1", max_tokens=12, stop=(stop,)))
    assert early[-1].finish_reason == "stop_sequence"
    late = await _events(engine, _req("m2", max_tokens=12, stop=(stop,),
                                      min_tokens=len(pieces)))
    assert late[-1].finish_reason in ("length", "stop_sequence")
    assert sum(isinstance(e, TokenEvent) for e in late) > sum(
        isinstance(e, TokenEvent) for e in early)


def test_unsupported_model_types_are_refused(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text",
                                                      "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match="does not support model type 'gemma3_text'"):
        ModelConfig(name="g", engine="pipeline", source=str(tmp_path))


async def test_bfloat16_pipeline_follows_the_unsplit_bfloat16_model():
    """The embedded model with bf16 weights and activations, digests on: greedy tokens equal
    the unsplit bf16 model's ``generate``; logprobs within the bf16 tolerance the e2e suite uses
    (tests/serve_session.py: a logit near 20 is resolved to 0.125 in bf16). The prompt fits one
    prefill chunk, so both sides run the same kernel shapes on any CPU (bf16 rounding differs
    between shapes enough to flip a close greedy choice)."""
    from engines.kit.embedded import prepare_embedded_model
    from tests.serve_session import LOGPROB_TOLERANCE

    path = prepare_embedded_model(progress=False)
    config = ModelConfig(name="bf16", engine="pipeline",
                         engine_args={"dtype": "bfloat16", "digest": True})
    cores = [StageCore(load_layers(path, a, b, torch.bfloat16), a, b) for a, b in [(1, 15),
                                                                                   (15, 30)]]
    engine = PipelineEngine(config, stages=LocalStages(cores))
    assert engine.model_info().dtype == "bfloat16"
    events = await _events(engine, _req("bf16", max_tokens=8, output=OutputOptions(logprobs=0)))
    reference = await engine.reference_greedy(PROMPT, 8)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [t.token_id for t in tokens] == reference.token_ids
    for token, logprob in zip(tokens, reference.logprobs, strict=True):
        assert token.logprob == pytest.approx(logprob, abs=LOGPROB_TOLERANCE["bfloat16"])

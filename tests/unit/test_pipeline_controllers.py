"""Controllers on the pipeline kind: the tiny split model with in-process stages behind the
real EngineHost and a real controller runtime (threads of this process, over shared memory).
Oracles: the grammar itself (``re.fullmatch``), and the unsplit HF model's own logits for which
of the grammar's two words a greedy pick must take."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from contract import (
    ControllerSpec,
    ErrorEvent,
    FinalEvent,
    ForkEvent,
    GenerateRequest,
    OutputOptions,
    Sampling,
    TextPrompt,
    TokenEvent,
)
from engines.kit.config import Controllers
from engines.pipeline.engine import PipelineEngine
from engines.replica.host import EngineHost
from tests.pipeline_models import local_pipeline

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(tiny_dir) -> PipelineEngine:
    return local_pipeline(tiny_dir, controllers=Controllers(
        custom={"scripted": "tests.controllers:Scripted"}))


def _grammar(lark: str) -> ControllerSpec:
    return ControllerSpec(module="llguidance",
                          arg=json.dumps({"grammar": {"grammars": [{"lark_grammar": lark}]}}))


async def _run(engine, controller: ControllerSpec, max_tokens: int = 12, prompt: str = PROMPT):
    request = GenerateRequest(request_id=f"c-{id(controller)}-{prompt}", model="tiny",
                              prompt=TextPrompt(text=prompt),
                              sampling=Sampling(temperature=0, max_tokens=max_tokens),
                              controller=controller)
    events = [e async for e in EngineHost(engine).generate(request)]
    text = "".join(e.text for e in events if isinstance(e, TokenEvent | FinalEvent))
    return events, text


def test_the_kind_says_it_runs_controllers(engine):
    info = engine.model_info()
    assert info.capabilities.controllers == "mask"
    assert "llguidance" in {tag.tag for tag in info.controllers}


async def test_a_grammar_bounds_what_a_random_model_writes(engine):
    events, text = await _run(engine, _grammar("start: /[a-z]{2,5}/"))
    assert not [e for e in events if isinstance(e, ErrorEvent)], events
    assert re.fullmatch(r"[a-z]{2,5}", text), text
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.finish_reason == "eos"  # the grammar ended


async def test_text_the_grammar_forces_is_appended_without_sampling(engine):
    events, text = await _run(engine, _grammar('start: "The answer is " /[0-9]/'))
    assert re.fullmatch(r"The answer is [0-9]", text), text
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.usage.forced_tokens >= 1
    assert final.usage.completion_tokens == len([e for e in events if isinstance(e, TokenEvent)])


async def test_a_greedy_choice_between_two_words_is_the_unsplit_models(engine, tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    words = [w for w in (" cat", " dog", " sun", " sea", " red", " blue")
             if len(tokenizer.encode(w, add_special_tokens=False)) == 1][:2]
    assert len(words) == 2, "the test needs two single-token words"
    ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in words]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    expected = words[int(torch.argmax(logits[ids]))]
    _, text = await _run(engine, _grammar(f'start: "{words[0]}" | "{words[1]}"'), max_tokens=4)
    assert text == expected


async def test_concurrent_controlled_sequences_share_one_round_trip_per_micro_batch(
        engine, monkeypatch):
    main = engine._hook._main
    calls = []
    real = main.call
    monkeypatch.setattr(main, "call", lambda *a, **k: calls.append(len(k["mid_ops"])) or real(*a, **k))
    runs = await asyncio.gather(*(_run(engine, _grammar("start: /[a-z]{6,8}/"), prompt=p)
                                  for p in ("The capital of France is", "Hello", "One two",
                                            "Paris")))
    for events, text in runs:
        assert re.fullmatch(r"[a-z]{6,8}", text), (text, events[-1])
    assert sum(calls) > len(calls)  # some steps asked for several sequences at once


async def test_forked_branches_each_run_as_a_sequence_of_their_own(engine):
    """Two branches of one request decode at the same time, each its own sequence in the pipe
    (one shared id would mix their caches); unmasked, each is the model's greedy output."""
    reference = await engine.reference_greedy(PROMPT, 6)
    request = GenerateRequest(request_id="fork", model="tiny", prompt=TextPrompt(text=PROMPT),
                              sampling=Sampling(temperature=0, max_tokens=6),
                              output=OutputOptions(splices="full"),
                              controller=ControllerSpec(module="scripted", arg="forks=2"))
    events = [e async for e in EngineHost(engine).generate(request)]
    assert not [e for e in events if isinstance(e, ErrorEvent)], events
    assert [e.index for e in events if isinstance(e, ForkEvent)] == [1]
    for index in (0, 1):
        tokens = [e.token_id for e in events if isinstance(e, TokenEvent) and e.index == index]
        assert tokens == reference.token_ids, index


async def test_an_unknown_controller_is_a_validation_error(engine):
    events, _ = await _run(engine, ControllerSpec(module="no-such-controller"))
    assert len(events) == 1 and isinstance(events[0], ErrorEvent)
    assert events[0].kind == "validation" and events[0].param == "controller"

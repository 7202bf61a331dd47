"""The pipeline's micro-batches (docs/protocols/pipeline.md, "Batching"): sequences of mixed
lengths run together give each one what it gets alone and what the unsplit model gives; a
sequence that loses its cache restarts alone; a slow reader holds back only its own sequence.

CPU, fp32, tiny random checkpoints, no Ray: ``InOrderStages`` runs the stages on a thread of
their own, in submission order as Ray runs an actor's calls, so several micro-batches are in
flight at once as with ``RayStages``."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engines.pipeline.jobs import Job, Sequence
from engines.pipeline.loading import load_layers, load_origin
from engines.pipeline.origin import Origin
from engines.pipeline.stage import StageCore
from engines.pipeline.stages import LocalStages
from tests.pipeline_models import build_tiny

RANGES = {"llama": [(1, 3), (3, 6)], "qwen3-sliding": [(1, 3), (3, 6)]}
PROMPTS = [3, 11, 1, 7, 20, 5]  # lengths: chunks of 4, one token, past the sliding window (5)
DECODE = 6


class InOrderStages(LocalStages):
    """The stages on one thread of their own, in submission order; up to ``depth`` micro-batches
    in flight."""

    depth = 3

    def __init__(self, cores):
        super().__init__(cores)
        self.pool = ThreadPoolExecutor(1)

    def submit(self, hop, check):
        return _Later(self.pool.submit(LocalStages.submit, self, hop, check))


class _Later:
    """Awaits a stage run on another thread (its result: a ``Resolved``)."""

    def __init__(self, future):
        self.future = future

    def __await__(self):
        resolved = yield from asyncio.wrap_future(self.future).__await__()
        return (yield from resolved.__await__())


@pytest.fixture(scope="module", params=list(RANGES))
def tiny(request, tmp_path_factory):
    return request.param, build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def _origin(path, ranges, stages_cls=LocalStages, **kwargs) -> Origin:
    cores = [StageCore(load_layers(path, a, b), a, b) for a, b in ranges]
    return Origin(load_origin(path, ranges[0][0]), ranges[0][0], stages_cls(cores),
                  prefill_chunk=4, max_restarts=2, check_digest=kwargs.pop("digest", False),
                  **kwargs)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPTS]


def _greedy_job(seq_id: str, prompt: list[int], steps: int = DECODE) -> Job:
    seq = Sequence(seq_id=seq_id, tokens=list(prompt))

    def step(logits, _prompt):
        token = int(torch.argmax(logits))
        seq.tokens.append(token)
        return (token, logits), len(seq.tokens) - len(prompt) >= steps

    return Job(seq, step)


async def _run(origin: Origin, job: Job) -> tuple[list[int], torch.Tensor]:
    got = [item async for item in origin.generate(job)]
    return [t for t, _ in got], torch.stack([row for _, row in got])


async def _alone(path, ranges, prompts):
    origin = _origin(path, ranges)
    return [await _run(origin, _greedy_job(f"a{i}", p)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("stages_cls", [LocalStages, InOrderStages])
async def test_mixed_lengths_together_give_each_sequence_its_own_run(tiny, stages_cls):
    kind, path = tiny
    prompts = _prompts(100)
    alone = await _alone(path, RANGES[kind], prompts)
    origin = _origin(path, RANGES[kind], stages_cls, digest=True)
    together = await asyncio.gather(*(_run(origin, _greedy_job(f"t{i}", p))
                                      for i, p in enumerate(prompts)))
    for (tokens, logits), (tokens_alone, logits_alone) in zip(together, alone, strict=True):
        assert tokens == tokens_alone
        assert (logits - logits_alone).abs().max().item() < 1e-4
    # Batched: far fewer micro-batches than one per sequence and step.
    steps = sum(-(-n // 4) + DECODE - 1 for n in PROMPTS)
    print("micro-batches", origin.batches, "of", steps, "sequence steps")
    assert origin.batches < steps * 0.7, (origin.batches, steps)
    assert origin.restarts == 0
    assert all(core.cached() == {} for core in origin.stages.cores)


async def test_few_sequences_that_started_apart_decode_as_one_micro_batch(tiny):
    """With fewer running sequences than one micro-batch holds, a sequence that started later
    joins the others' micro-batch instead of decoding in one of its own beside it (its steps
    cost almost what the others' do: two micro-batches of 2 do the work of 4 for the speed of
    2). Each still gets what it gets alone."""
    kind, path = tiny
    prompts, steps = _prompts(100)[:4], 24
    alone = await _alone(path, RANGES[kind], prompts)
    origin = _origin(path, RANGES[kind], InOrderStages)

    async def later(i: int, prompt: list[int]):
        await asyncio.sleep(0.01 * i)  # each arrives while the others decode
        return await _run(origin, _greedy_job(f"s{i}", prompt, steps))

    together = await asyncio.gather(*(later(i, p) for i, p in enumerate(prompts)))
    for (tokens, _), (tokens_alone, _) in zip(together, alone, strict=True):
        assert tokens[:DECODE] == tokens_alone
    # Apart, each sequence would take a micro-batch per step (4 x 24); together about one per
    # step, plus the prompts' chunks and the steps before the last one joined.
    prefill = sum(-(-len(p) // 4) for p in prompts)
    assert origin.batches < steps + prefill + 2 * steps // 3, origin.batches


async def test_mixed_lengths_together_match_the_unsplit_model(tiny):
    from transformers import AutoModelForCausalLM

    kind, path = tiny
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(reference.config.vocab_size)
    origin = _origin(path, RANGES[kind], InOrderStages)
    together = await asyncio.gather(*(_run(origin, _greedy_job(f"u{i}", p))
                                      for i, p in enumerate(prompts)))
    for prompt, (tokens, _) in zip(prompts, together, strict=True):
        with torch.inference_mode():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=DECODE,
                                          min_new_tokens=DECODE, do_sample=False,
                                          pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == expected


async def test_a_sequence_that_loses_its_cache_restarts_alone(tiny):
    kind, path = tiny
    prompts = _prompts(100)
    alone = await _alone(path, RANGES[kind], prompts)
    origin = _origin(path, RANGES[kind])
    calls = 0

    class Forgetful(LocalStages):
        def submit(self, hop, check):
            nonlocal calls
            calls += 1
            if calls == 8:  # mid-decode, the second stage forgets one sequence
                self.cores[1].free("t1")
            return super().submit(hop, check)

    origin.stages = Forgetful(origin.stages.cores)
    jobs = [_greedy_job(f"t{i}", p) for i, p in enumerate(prompts)]
    together = await asyncio.gather(*(_run(origin, job) for job in jobs))
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert origin.restarts == 1 and [job.seq.restarts for job in jobs] == [0, 1, 0, 0, 0, 0]


async def test_a_sequence_a_stage_leaves_out_without_a_word_restarts_instead_of_waiting(tiny):
    """A stage that sends a micro-batch on without one of its sequences and without saying why
    (a bug, a bad peer): that sequence restarts; it does not wait for a step that never comes."""
    kind, path = tiny
    prompts = _prompts(100)[:3]
    alone = await _alone(path, RANGES[kind], prompts)
    origin = _origin(path, RANGES[kind])
    calls = 0

    class Silent(LocalStages):
        def submit(self, hop, check):
            nonlocal calls
            calls += 1
            result = super().submit(hop, check)
            if calls == 6 and "t1" in hop.seq_ids:  # the answer comes back without t1
                keep = [i for i, sid in enumerate(result.hop.seq_ids) if sid != "t1"]
                result.hop = result.hop.only(keep)
            return result

    origin.stages = Silent(origin.stages.cores)
    jobs = [_greedy_job(f"t{i}", p) for i, p in enumerate(prompts)]
    async with asyncio.timeout(60):
        together = await asyncio.gather(*(_run(origin, job) for job in jobs))
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert [job.seq.restarts for job in jobs] == [0, 1, 0]


async def test_a_slow_reader_holds_back_only_its_own_sequence(tiny):
    kind, path = tiny
    origin = _origin(path, RANGES[kind])
    slow = _greedy_job("slow", [5, 6, 7], steps=40)
    fast = _greedy_job("fast", [8, 9], steps=30)
    slow_steps = origin.generate(slow)
    first = await anext(slow_steps)  # then the reader stops reading
    tokens, _ = await _run(origin, fast)  # the other sequence runs to its end meanwhile
    assert len(tokens) == 30 and first
    # The slow one went on only until its outbox was full: it waits, holding no more.
    assert slow.parked and len(slow.seq.tokens) - 3 <= 1 + 8
    rest = [item async for item in slow_steps]
    assert len(rest) == 39


async def test_an_error_inside_a_stage_restarts_that_micro_batch_and_the_scheduler_goes_on(tiny):
    """Any error from a stage (an out-of-memory, a bug), not only a lost cache: that
    micro-batch's sequences restart; past max_restarts they fail, and the next job runs."""
    from engines.pipeline.jobs import PipelineFailure
    from engines.pipeline.stages import Resolved

    kind, path = tiny
    prompts = _prompts(100)[:2]
    alone = await _alone(path, RANGES[kind], prompts)
    origin = _origin(path, RANGES[kind])
    working, calls, broken = origin.stages, 0, ()

    class OnceBroken(LocalStages):
        def submit(self, hop, check):
            nonlocal calls, broken
            calls += 1
            if calls == 3:
                broken = hop.seq_ids
                return Resolved(error=RuntimeError("out of memory"))
            return super().submit(hop, check)

    origin.stages = OnceBroken(working.cores)
    together = await asyncio.gather(*(_run(origin, _greedy_job(f"e{i}", p))
                                      for i, p in enumerate(prompts)))
    # every sequence of the failed micro-batch restarted (and only those)
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert broken and origin.restarts == len(broken)

    class Broken(LocalStages):
        def submit(self, hop, check):
            return Resolved(error=RuntimeError("out of memory"))

    origin.stages = Broken(working.cores)
    with pytest.raises(PipelineFailure, match=r"failed 3 times.*RuntimeError"):
        await _run(origin, _greedy_job("f", prompts[0]))
    origin.stages = working
    assert (await _run(origin, _greedy_job("g", prompts[0])))[0] == alone[0][0]
    assert all(core.cached() == {} for core in working.cores)

"""Pipeline stages against the unsplit model (``docs/protocols/pipeline.md``, "Parity"): CPU, fp32,
tiny random checkpoints from real config classes plus the embedded SmolLM2, no Ray.

Oracle: the unsplit HF model's own forward and ``generate(do_sample=False)``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.pipeline.jobs import Job, Sequence
from engines.pipeline.loading import load_layers, load_origin
from engines.pipeline.origin import Origin
from engines.pipeline.stage import Hop, StageCore
from engines.pipeline.stages import LocalStages, Resolved
from tests.pipeline_models import build_tiny

# Stage ranges per model; every Qwen3 stage starts on a sliding-window layer (odd index).
RANGES = {"llama": [(1, 3), (3, 4), (4, 6)], "llama-tied": [(1, 2), (2, 4), (4, 5)],
          "qwen3-sliding": [(1, 3), (3, 5), (5, 6)], "smollm2": [(1, 10), (10, 20), (20, 30)]}
PROMPT_LEN, CHUNK, DECODE = 11, 4, 8  # prefill chunks 4 + 4 + 3; the window (5) is shorter


@pytest.fixture(scope="module", params=list(RANGES))
def model_dir(request, tmp_path_factory) -> tuple[str, Path]:
    if request.param == "smollm2":
        from engines.kit.embedded import prepare_embedded_model

        return request.param, prepare_embedded_model(progress=False)
    return request.param, build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def _origin(path: Path, ranges, attn: str, stages_cls=LocalStages, **kwargs) -> Origin:
    cores = [StageCore(load_layers(path, a, b, attn_implementation=attn), a, b)
             for a, b in ranges]
    parts = load_origin(path, ranges[0][0], attn_implementation=attn)
    return Origin(parts, ranges[0][0], stages_cls(cores), prefill_chunk=CHUNK,
                  max_restarts=kwargs.pop("max_restarts", 2), check_digest=kwargs.pop("digest",
                                                                                       False))


def _reference(path: Path, attn: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=attn).eval()


def _greedy_step(seq: Sequence, steps: int):
    """A job's step that picks the argmax and hands back (token, logits row)."""

    def step(logits, _prompt):
        token = int(torch.argmax(logits))
        seq.tokens.append(token)
        return (token, logits), len(seq.tokens) - PROMPT_LEN >= steps

    return step


async def _greedy(origin: Origin, prompt: list[int], steps: int, seq_id: str = "s"):
    """Greedy decoding through the origin's scheduler: (tokens, per-step last-position logits)."""
    seq = Sequence(seq_id=seq_id, tokens=list(prompt))
    got = [item async for item in origin.generate(Job(seq, _greedy_step(seq, steps)))]
    return [token for token, _ in got], torch.stack([row for _, row in got])


def _prompt(vocab: int) -> list[int]:
    return torch.randint(3, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()


def _unsplit_logits(reference, ids: list[int]):
    """The unsplit model on the same schedule as the pipeline (chunks of the prompt, then one
    token per step, through HF's own cache): the logit at every position that picks a token.
    The same kernel shapes on both sides, so only the split itself could make them differ (a
    single full-sequence forward differs from any chunked one by fp32 rounding: 5e-5 on
    SmolLM2's 30 layers)."""
    from transformers import DynamicCache

    cache, rows, start = DynamicCache(config=reference.config), [], 0
    ends = [*range(CHUNK, PROMPT_LEN, CHUNK), PROMPT_LEN, *range(PROMPT_LEN + 1, len(ids))]
    for end in ends:
        out = reference(torch.tensor([ids[start:end]]), past_key_values=cache, use_cache=True,
                        position_ids=torch.arange(start, end)[None])
        if end >= PROMPT_LEN:
            rows.append(out.logits[0, -1])
        start = end
    return torch.stack(rows)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
async def test_logits_and_greedy_tokens_match_the_unsplit_model(model_dir, attn):
    kind, path = model_dir
    reference = _reference(path, attn)
    prompt = _prompt(reference.config.vocab_size)
    origin = _origin(path, RANGES[kind], attn)
    tokens, logits = await _greedy(origin, prompt, DECODE)
    with torch.inference_mode():
        expected = _unsplit_logits(reference, prompt + tokens)
        generated = reference.generate(torch.tensor([prompt]), max_new_tokens=DECODE,
                                       do_sample=False, min_new_tokens=DECODE,
                                       pad_token_id=0)[0, PROMPT_LEN:].tolist()
    # fp32 rounding only: the same kernels can still split their sums differently between
    # threads from run to run (1.05e-5 seen on a busy box, logits up to ~20, where one ulp is
    # 1.9e-6). A wrong split (a layer skipped or twice, a cache off by one) is orders larger.
    assert (logits - expected).abs().max().item() <= 20 * torch.finfo(torch.float32).eps * \
        expected.abs().max().item()
    assert tokens == generated


async def test_duplicated_steps_are_cropped_and_recomputed(tmp_path):
    """Every stage receives every hop twice (a retried delivery): same tokens, no restart."""
    path = build_tiny("llama", tmp_path / "m")

    class Twice(LocalStages):
        def submit(self, hop, check):
            for core in self.cores:
                core.forward(hop, check)
            return super().submit(hop, check)

    plain, _ = await _greedy(_origin(path, RANGES["llama"], "sdpa"), _prompt(100), DECODE)
    origin = _origin(path, RANGES["llama"], "sdpa", Twice)
    tokens, _ = await _greedy(origin, _prompt(100), DECODE)
    assert tokens == plain and origin.restarts == 0


def test_a_lost_step_drops_that_sequence_only_and_a_repeated_one_is_recomputed(tmp_path):
    path = build_tiny("qwen3-sliding", tmp_path / "m")
    core = StageCore(load_layers(path, 1, 6), 1, 6)

    def hop(first: int, length: int, seq_id: str, seed: int = 0) -> Hop:
        hidden = torch.randn(1, length, 64, generator=torch.Generator().manual_seed(seed))
        return Hop.single(hidden, torch.arange(first, first + length), seq_id)

    core.forward(hop(0, 11, "s"))
    out = core.forward(hop(12, 1, "s"))  # position 11 never arrived
    assert "12 but 11 cached" in out.dropped["s"] and out.seq_ids == ()
    assert core.cached() == {}  # a dropped sequence's cache goes: the origin restarts it from 0
    core.forward(hop(0, 11, "s"))
    once = core.forward(hop(11, 1, "s", seed=1)).hidden
    # The pool keeps every position, so a sliding layer crops back past its window too.
    again = core.forward(hop(11, 1, "s", seed=1))
    assert again.seq_ids == ("s",) and torch.equal(again.hidden, once)
    assert core.cached() == {"s": 12}
    assert "no cache" in core.forward(hop(5, 1, "other")).dropped["other"]


async def test_a_lost_cache_restarts_from_the_origin_tokens(tmp_path):
    """A stage forgets a sequence mid-decode (an orphan sweep, a respawned actor): the next step
    is a cache mismatch, the origin re-prefills every token, and the output is unchanged."""
    path = build_tiny("qwen3-sliding", tmp_path / "m")
    plain, _ = await _greedy(_origin(path, RANGES["qwen3-sliding"], "sdpa"), _prompt(100), DECODE)
    origin = _origin(path, RANGES["qwen3-sliding"], "sdpa")
    calls = 0

    class Forgetful(LocalStages):
        def submit(self, hop, check):
            nonlocal calls
            calls += 1
            if calls == 6:  # prefill took 3 calls; the third decode step finds no cache
                self.cores[1].sweep(ttl_s=-1)
            return super().submit(hop, check)

    origin.stages = Forgetful(origin.stages.cores)
    tokens, _ = await _greedy(origin, _prompt(100), DECODE)
    assert tokens == plain and origin.restarts == 1
    assert all(core.cached() == {} for core in origin.stages.cores)


async def test_digests_are_checked_on_every_hop(tmp_path):
    path = build_tiny("llama", tmp_path / "m")
    origin = _origin(path, RANGES["llama"], "sdpa", digest=True, max_restarts=0)
    plain, _ = await _greedy(_origin(path, RANGES["llama"], "sdpa"), _prompt(100), 3)
    assert (await _greedy(origin, _prompt(100), 3))[0] == plain

    from engines.pipeline.jobs import PipelineFailure

    cores = origin.stages.cores
    for hop_index in range(len(cores) + 1):  # origin → stage 0, stage i → i+1, last → origin

        class Tamper(LocalStages):
            def submit(self, hop, check, at=hop_index):
                try:
                    for i, core in enumerate(self.cores):
                        if i == at:
                            hop.hidden = hop.hidden + 1e-3  # corrupted in transit
                        hop = core.forward(hop, check)
                    if at == len(self.cores):
                        hop.hidden = hop.hidden + 1e-3
                except Exception as exc:
                    return Resolved(error=exc)
                return Resolved(hop)

        origin.stages = Tamper(cores)
        with pytest.raises(PipelineFailure, match="CacheMismatch"):
            await _greedy(origin, _prompt(100), 3, seq_id=f"t{hop_index}")
        assert all(core.cached() == {} for core in cores)


def test_a_stage_reads_only_its_layers_tensors(tmp_path, monkeypatch):
    import safetensors

    path = build_tiny("llama", tmp_path / "m")
    read: list[str] = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.f = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    model = load_layers(path, 2, 4)
    assert read and all(name.startswith(("model.layers.2.", "model.layers.3.")) for name in read)
    assert len(model.layers) == 2 and model.embed_tokens is None
    assert all(p.device.type == "cpu" for p in model.parameters())

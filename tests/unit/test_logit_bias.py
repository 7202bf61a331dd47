"""The wide logit_bias processor inside vLLM (engines.vllm.logit_bias), driven as each of vLLM's
model runners drives it: the V1 runner's ``BatchUpdate`` (added / removed / moved rows) and
Model Runner V2's slots and ``LogitsContext``. Oracle: the dense bias added row by row."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from engines.vllm.logit_bias import (
    BIAS_ARG,
    PROCESSOR,
    VLLM_MAX_ENTRIES,
    WideLogitBias,
    pack_bias,
)

VOCAB = 4096


def _bias(seed: int, entries: int = 3000) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    ids = rng.choice(VOCAB, size=entries, replace=False)
    return {int(t): float(v) for t, v in zip(ids, rng.uniform(-150, 150, entries), strict=True)}


def _params(bias: dict[int, float] | None) -> SamplingParams:
    return SamplingParams(max_tokens=4, extra_args={BIAS_ARG: pack_bias(bias)} if bias else None)


def _dense(bias: dict[int, float] | None) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    for token, value in (bias or {}).items():
        row[token] = min(100.0, max(-100.0, value))  # vLLM clamps to [-100, 100]
    return row


def _update(added=(), removed=(), moved=()):
    return BatchUpdate(batch_size=8, removed=list(removed), added=list(added), moved=list(moved))


def _check(processor, biases_by_row: list[dict | None], ctx=None) -> None:
    logits = torch.randn(len(biases_by_row), VOCAB)
    expected = logits + torch.stack([_dense(b) for b in biases_by_row])
    out = processor.apply(logits.clone(), ctx) if ctx is not None else processor.apply(
        logits.clone())
    assert torch.allclose(out, expected, atol=1e-5)


def test_v1_rows_follow_adds_removals_swaps_and_moves():
    lp = WideLogitBias(None, torch.device("cpu"), False)
    a, b, c = _bias(1), _bias(2), _bias(3)
    lp.update_state(_update(added=[(0, _params(a), [], []), (1, _params(None), [], []),
                                   (2, _params(b), [], [])]))
    _check(lp, [a, None, b])
    lp.update_state(_update(moved=[(0, 2, MoveDirectionality.SWAP)]))
    _check(lp, [b, None, a])
    lp.update_state(_update(removed=[1], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    _check(lp, [b, a])
    lp.update_state(_update(added=[(0, _params(c), [], [])]))  # replaces row 0's occupant
    _check(lp, [c, a])
    lp.update_state(_update(added=[(1, _params(None), [], [])]))
    _check(lp, [c, None])
    lp.update_state(None)  # no change: the gathered batch stays
    _check(lp, [c, None])


def test_mrv2_slots_are_mapped_to_this_steps_rows():
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

    lp = WideLogitBias(None, SimpleNamespace(device=torch.device("cpu")))
    a, b = _bias(4), _bias(5)
    assert lp.add_request(3, _params(a)) is True
    assert lp.add_request(0, _params(None)) is False
    assert lp.add_request(1, _params(b)) is True

    def ctx(slots):
        mapping = torch.tensor(slots, dtype=torch.int32)
        return LogitsContext(expanded_idx_mapping=mapping, idx_mapping=mapping,
                             idx_mapping_np=np.array(slots, dtype=np.int32),
                             expanded_local_pos=torch.zeros(len(slots), dtype=torch.int32),
                             input_ids=torch.zeros(len(slots), dtype=torch.long),
                             pos=torch.zeros(len(slots), dtype=torch.long),
                             seq_lens_upper_bound_np=np.ones(len(slots)))

    _check(lp, [None, b, a], ctx([0, 1, 3]))
    _check(lp, [a, None], ctx([3, 0]))
    assert lp.add_request(3, _params(None)) is False  # the slot's next request has no bias
    _check(lp, [None, b], ctx([3, 1]))


def test_a_malformed_bias_is_refused_at_admission():
    with pytest.raises(ValueError, match=BIAS_ARG):
        WideLogitBias.validate_params(SamplingParams(extra_args={BIAS_ARG: {"ids": b"1234"}}))
    WideLogitBias.validate_params(_params(_bias(6)))


def test_vllm_loads_it_by_name_for_both_runners():
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns
    from vllm.v1.worker.gpu.sample.logits_processor.loader import (
        _load_v2_logitsprocs_by_fqcns,
    )

    assert _load_v2_logitsprocs_by_fqcns([PROCESSOR]) == [WideLogitBias]
    assert WideLogitBias in _load_logitsprocs_by_fqcns([PROCESSOR])


def test_the_engine_sends_a_large_bias_packed_and_a_small_one_to_vllm():
    from contract import GenerateRequest, Sampling, TextPrompt
    from engines.vllm.engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # only what _sampling_params reads
    engine.tokenizer = SimpleNamespace(eos_token_id=2)

    def params(entries):
        bias = {t: -100.0 for t in range(entries)}
        return engine._sampling_params(GenerateRequest(
            request_id="r", model="m", prompt=TextPrompt(text="x"),
            sampling=Sampling(max_tokens=2, logit_bias=bias)), 2)

    small, large = params(VLLM_MAX_ENTRIES), params(VLLM_MAX_ENTRIES + 1)
    assert len(small.logit_bias) == VLLM_MAX_ENTRIES and not (small.extra_args or {})
    assert not large.logit_bias
    ids = np.frombuffer(large.extra_args[BIAS_ARG]["ids"], dtype=np.int32)
    assert ids.tolist() == list(range(VLLM_MAX_ENTRIES + 1))

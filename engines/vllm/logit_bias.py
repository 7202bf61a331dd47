"""``logit_bias`` beyond vLLM's own bound: a logits processor for both of vLLM's model runners.

LMQL constrains decoding by sending half the vocabulary as ``logit_bias`` (about 24,000 entries
for SmolLM2). vLLM cannot take that through ``SamplingParams.logit_bias``: its GPU model runner
(Model Runner V2) holds at most 1,024 entries per request and fails a request with more inside
the engine, and its CPU runner rebuilds the whole batch's bias from Python dicts whenever the
batch changes (77 ms at 16 requests of 20,000 entries, measured on the AVX-512 box). A request
with more than :data:`VLLM_MAX_ENTRIES` entries carries its bias in ``extra_args[BIAS_ARG]``
instead, as two packed arrays; this processor turns them into one pair of tensors when the
request joins the batch and adds every biased row's in one indexed add per step.

Semantics: vLLM's (each value clamped to [-100, 100], added to the logits). On the CPU runner
it is applied with vLLM's own bias, before penalties; Model Runner V2 runs custom processors
after its penalties (docs/reliability.md).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

__all__ = ["BIAS_ARG", "PROCESSOR", "VLLM_MAX_ENTRIES", "WideLogitBias", "pack_bias"]

logger = logging.getLogger(__name__)

BIAS_ARG = "wide_logit_bias"
PROCESSOR = "engines.vllm.logit_bias:WideLogitBias"
# vLLM's GPU model runner's bound (MAX_NUM_LOGIT_BIAS_TOKENS); up to it, vLLM's own bias.
VLLM_MAX_ENTRIES = 1024

Bias = tuple[torch.Tensor, torch.Tensor]  # token ids (int64), values (float32)


def pack_bias(bias: dict[int, float]) -> dict[str, bytes]:
    """``extra_args[BIAS_ARG]`` for ``bias``: msgpack carries bytes to the engine core as they
    are (a dict of 24,000 entries would be 24,000 map items)."""
    ids = np.fromiter(bias.keys(), dtype=np.int32, count=len(bias))
    values = np.clip(np.fromiter(bias.values(), dtype=np.float32, count=len(bias)), -100, 100)
    return {"ids": ids.tobytes(), "values": values.tobytes()}


def _unpack(params: SamplingParams | None, device: torch.device) -> Bias | None:
    """The request's bias as tensors on ``device``; ``ValueError`` when malformed."""
    spec = ((params.extra_args if params is not None else None) or {}).get(BIAS_ARG)
    if spec is None:
        return None
    ids, values = (spec.get(k) if isinstance(spec, dict) else None for k in ("ids", "values"))
    if not isinstance(ids, bytes) or not isinstance(values, bytes) or len(ids) != len(values) \
            or len(ids) % 4:
        raise ValueError(f'extra_args["{BIAS_ARG}"] is {{"ids": int32 bytes, '
                         '"values": float32 bytes}} of one length')
    token_ids = torch.frombuffer(bytearray(ids), dtype=torch.int32).to(torch.long)
    return token_ids.to(device), torch.frombuffer(bytearray(values), dtype=torch.float32).to(device)


def _gather(biases: list[tuple[int, Bias]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(rows, token ids, values) of every (row, bias) pair, for one ``index_put_``."""
    rows = torch.cat([torch.full_like(ids, row) for row, (ids, _) in biases])
    return (rows.to(device), torch.cat([ids for _, (ids, _) in biases]).to(device),
            torch.cat([values for _, (_, values) in biases]).to(device))


class WideLogitBias(LogitsProcessor, V2LogitsProcessor):
    def __init__(self, vllm_config, *runner_args) -> None:
        # V1: (device, is_pin_memory); MRV2: (req_states,)
        self._device = runner_args[0] if len(runner_args) == 2 else runner_args[0].device
        self._rows: dict[int, Bias] = {}  # V1: batch row → its bias; MRV2: request slot → it
        self._batch: tuple[torch.Tensor, ...] | None = None  # V1: the batch's, gathered

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        _unpack(sampling_params, torch.device("cpu"))  # at admission: a bad one is refused

    def is_argmax_invariant(self) -> bool:
        return False  # a bias changes the greedy choice

    # --- V1 model runner (vLLM's CPU build) --------------------------------------------------

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        rows, changed = self._rows, False
        for index in batch_update.removed:
            changed |= rows.pop(index, None) is not None
        for index, params, _prompt, _output in batch_update.added:
            changed |= rows.pop(index, None) is not None  # it may replace the row's occupant
            bias = self._bias_of(params)
            if bias is not None:
                rows[index], changed = bias, True
        for a, b, direction in batch_update.moved:
            bias_a, bias_b = rows.pop(a, None), rows.pop(b, None)
            changed |= bias_a is not None or bias_b is not None
            if direction == MoveDirectionality.SWAP and bias_b is not None:
                rows[a] = bias_b
            if bias_a is not None:
                rows[b] = bias_a
        if changed:
            self._batch = _gather(sorted(rows.items()), self._device) if rows else None

    def _bias_of(self, params: SamplingParams | None) -> Bias | None:
        try:  # nothing may raise here: it would take the engine down
            return _unpack(params, self._device)
        except ValueError as exc:  # validate_params refused it already; never reached
            logger.error("ignoring a malformed wide logit bias: %s", exc)
            return None

    # --- Model Runner V2 (vLLM's GPU default) ------------------------------------------------

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        self._rows.pop(req_idx, None)  # the slot's previous request is gone
        bias = self._bias_of(sampling_params)
        if bias is not None:
            self._rows[req_idx] = bias
        return bias is not None

    def _v2_batch(self, logits: torch.Tensor, ctx) -> tuple[torch.Tensor, ...] | None:
        slots = ctx.idx_mapping_np
        if logits.shape[0] != len(slots):  # a row per draft token: speculative decoding
            slots = ctx.expanded_idx_mapping.tolist()
        biased = [(row, self._rows[int(slot)]) for row, slot in enumerate(slots)
                  if int(slot) in self._rows]
        return _gather(biased, logits.device) if biased else None

    def apply(self, logits: torch.Tensor, ctx=None) -> torch.Tensor:
        if ctx is not None:  # MRV2
            batch = self._v2_batch(logits, ctx) if self._rows else None
        else:
            batch = self._batch
        if batch is not None:
            rows, ids, values = batch
            logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)
        return logits

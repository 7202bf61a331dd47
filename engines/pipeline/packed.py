"""Several sequences through one set of decoder layers as one forward (docs/protocols/pipeline.md,
"Batching").

The tokens of every sequence in a micro-batch are packed end to end into one ``[1, T, H]``
tensor. Everything per token (norms, projections, rotary embeddings, MLP) runs over the packed
tensor as it is, so the weights are read once per micro-batch, not once per sequence. The new
keys and values of all of them go into the stage's :class:`~engines.pipeline.kvpool.KVPool` in one
indexed copy per layer (:class:`PooledBatch`); :func:`packed_attention` then attends the
sequences that take one token (decode steps) together, their keys gathered from the pool and
padded to the longest, and each longer chunk (a prefill) on its own, with HF's own ``sdpa`` or
``eager`` kernel. The kernels a layer launches do not grow with the decode steps it carries.

The layers are the model's own HF decoder layers, called one after another; the attention is
selected by name through HF's ``AttentionInterface`` (:func:`use_packed_attention`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PooledBatch", "packed_attention", "run_layers", "use_packed_attention"]

_PREFIX = "pipeline_packed:"


@dataclass
class PooledBatch:
    """A micro-batch's sequences in packed order, with the pool slots their tokens are written
    to and read from; passed to the layers as their ``past_key_values`` and (as ``packed``) to
    the attention. Built once per forward, on the layers' device (:meth:`build`)."""

    pool: Any  # the stage's KVPool
    lengths: list[int]  # new tokens per sequence
    firsts: list[int]  # absolute position of each sequence's first new token
    positions: Any  # [T] each packed token's position in its sequence
    writes: Any  # [T] the slot of each packed token
    decode_rows: Any  # [D] packed rows of the sequences that take one token, or None
    decode_reads: Any  # [D, longest] their slots by position (padding: slot 0, masked)
    decode_lengths: Any  # [D] their keys, this token included
    decode_ends: list[int]  # the same, on the host
    chunk_reads: list[Any]  # per longer chunk (in packed order): its slots by position
    # The masks are the same in every layer of one kind (full or sliding): built once.
    masks: dict[tuple, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, pool, seq_ids, lengths: list[int], firsts: list[int], positions,
              device) -> PooledBatch:
        """The slots of a micro-batch whose sequences the pool already holds room for, and its
        ``positions`` (host), moved to ``device`` together."""
        import torch
        from torch.nn.utils.rnn import pad_sequence

        ends = [f + n for f, n in zip(firsts, lengths, strict=True)]
        decode = [i for i, n in enumerate(lengths) if n == 1]
        decode_ends = [ends[i] for i in decode]
        parts = [positions.to(torch.long),
                 torch.cat([pool.table(s, f, e) for s, f, e in zip(seq_ids, firsts, ends,
                                                                       strict=True)])]
        if decode:
            starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
            parts += [torch.tensor([starts[i] for i in decode]),
                      pad_sequence([pool.table(seq_ids[i], 0, ends[i]) for i in decode],
                                   batch_first=True),
                      torch.tensor(decode_ends)]
        parts += [pool.table(seq_ids[i], 0, ends[i]) for i, n in enumerate(lengths) if n > 1]
        moved = _to_device(parts, device)
        if decode:
            return cls(pool, lengths, firsts, *moved[:5], decode_ends, moved[5:])
        return cls(pool, lengths, firsts, *moved[:2], None, None, None, decode_ends, moved[2:])

    def update(self, keys, values, layer_idx: int, *_: Any) -> tuple[Any, Any]:
        """Write the micro-batch's new keys and values into the pool; this layer's slots."""
        return self.pool.write(layer_idx, keys, values, self.writes)

    def decode_mask(self, inner: str, window: int | None, query) -> Any:
        """Which padded keys each decode step sees: its own, within the window; None when each
        sees every key of the gather."""
        import torch

        key = ("decode", window)
        if key not in self.masks:
            longest = max(self.decode_ends)
            if min(self.decode_ends) == longest and (window is None or longest <= window):
                self.masks[key] = None  # decided on the host: no wait for the device
            else:
                column = torch.arange(longest, device=query.device)[None, :]
                ends = self.decode_lengths[:, None]
                allowed = column < ends
                if window is not None:
                    allowed &= column > ends - 1 - window
                self.masks[key] = _as_mask(inner, allowed[:, None], query)
        return self.masks[key]

    def chunk_mask(self, i: int, chunk: int, inner: str, window: int | None, query) -> Any:
        """Sequence ``i``'s mask (see :func:`_mask`), once per chunk and window."""
        key = (i, window)
        if key not in self.masks:
            self.masks[key] = _mask(inner, self.firsts[i], self.lengths[i],
                                    self.chunk_reads[chunk].shape[0], window, query)
        return self.masks[key]


def packed_attention(inner: str, module, query, keys, values, attention_mask, *,
                     packed: PooledBatch, scaling: float | None = None,
                     sliding_window: int | None = None, **_: Any) -> tuple[Any, None]:
    """Each sequence's queries against its own keys from the pool (``keys``/``values``: the
    layer's ``[slots, kv_heads, head_dim]``): ``[1, T, heads, head_dim]``, packed."""
    import torch

    kernel = _kernel(inner, module)
    options = dict(scaling=scaling, dropout=0.0, sliding_window=sliding_window)
    tokens = query[0].transpose(0, 1)  # [T, heads, head_dim]
    only_decode = len(packed.decode_ends) == len(packed.lengths)  # no gather, no scatter
    out = None if only_decode else torch.empty_like(tokens)
    if packed.decode_rows is not None:
        mask = packed.decode_mask(inner, sliding_window, query)
        got, _ = kernel(module, (tokens if only_decode else tokens[packed.decode_rows])[:, :, None],
                        _gather(keys, packed.decode_reads), _gather(values, packed.decode_reads),
                        mask, **options)
        if only_decode:
            return got.transpose(0, 1), None
        out[packed.decode_rows] = got[:, 0]
    start, chunk = 0, 0
    for i, length in enumerate(packed.lengths):
        if length > 1:
            reads = packed.chunk_reads[chunk]
            mask = packed.chunk_mask(i, chunk, inner, sliding_window, query)
            got, _ = kernel(module, tokens[start:start + length].transpose(0, 1)[None],
                            _gather(keys, reads[None]), _gather(values, reads[None]), mask,
                            **options)
            out[start:start + length] = got[0]
            chunk += 1
        start += length
    return out[None], None


def _to_device(parts: list[Any], device) -> list[Any]:
    """``parts`` (host long tensors) on ``device`` in one copy. On a GPU, from pinned memory
    and without waiting: a copy from pageable memory would first wait for every kernel queued
    before it, and the host would stop running ahead of the device."""
    import torch

    if torch.device(device).type != "cuda":
        return parts
    flat = torch.cat([part.reshape(-1) for part in parts]).pin_memory()
    moved = flat.to(device, non_blocking=True).split([part.numel() for part in parts])
    return [m.view(part.shape) for m, part in zip(moved, parts, strict=True)]


def _gather(slots, reads):
    """The slots ``reads`` ``[B, L]`` of a layer's ``[slots, kv_heads, head_dim]``, as the
    kernels take keys: ``[B, kv_heads, L, head_dim]``."""
    batch, length = reads.shape
    return slots.index_select(0, reads.reshape(-1)).view(batch, length, *slots.shape[1:]) \
        .transpose(1, 2)


def _kernel(inner: str, module):
    if inner == "eager":  # each model family's own (they agree; softmax in float32)
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _mask(inner: str, first: int, length: int, kv_length: int, window: int | None, query):
    """Which keys each of a sequence's new tokens may see (the keys of positions
    ``[0, kv_length)``)."""
    import torch

    end = first + length
    query_pos = torch.arange(first, end, device=query.device)[:, None]
    key_pos = torch.arange(end - kv_length, end, device=query.device)[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    return _as_mask(inner, allowed[None], query)


def _as_mask(inner: str, allowed, query):
    """``allowed`` ``[batch, queries, keys]`` as the kernel takes it: boolean for ``sdpa``,
    additive for HF's eager kernel."""
    import torch

    if inner == "eager":
        return torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~allowed, torch.finfo(query.dtype).min)[:, None]
    return allowed[:, None]


def use_packed_attention(model) -> None:
    """Route ``model``'s attention through :func:`packed_attention` (registered under a name
    that keeps the configured kernel, ``sdpa`` or ``eager``, for each sequence)."""
    from functools import partial

    from transformers import AttentionInterface

    inner = model.config._attn_implementation
    if inner.startswith(_PREFIX):
        return
    if inner not in ("sdpa", "eager"):
        raise ValueError(f"attn_implementation {inner!r}: the pipeline batches with sdpa or eager")
    AttentionInterface.register(_PREFIX + inner, partial(packed_attention, inner))
    model.config._attn_implementation = _PREFIX + inner


def run_layers(model, hidden, packed: PooledBatch):
    """``model``'s decoder layers (a sliced base model, see ``loading``) over a packed micro-batch
    ``hidden`` ``[1, T, H]`` at ``packed.positions``; then its norm (Identity on a stage)."""
    position_ids = packed.positions[None]
    rotary = model.rotary_emb(hidden, position_ids)
    for layer in model.layers[: model.config.num_hidden_layers]:
        hidden = layer(hidden, attention_mask=None, position_ids=position_ids,
                       past_key_values=packed, use_cache=True, position_embeddings=rotary,
                       packed=packed)
    return model.norm(hidden)

"""Several sequences through one set of decoder layers as one forward (docs/protocols/pipeline.md,
"Batching").

The tokens of every sequence in a micro-batch are packed end to end into one ``[1, T, H]``
tensor. Everything per token (norms, projections, rotary embeddings, MLP) runs over the packed
tensor as it is, so the weights are read once per micro-batch, not once per sequence; only
attention is per sequence: :class:`PackedCaches` hands each sequence's slice of the new keys
and values to that sequence's own ``DynamicCache`` (full and sliding-window layers as HF builds
them), and :func:`packed_attention` attends each sequence's queries to its own keys with HF's
own ``sdpa`` or ``eager`` kernel. No padding, no copy of any cache.

The layers are the model's own HF decoder layers, called one after another; the attention is
selected by name through HF's ``AttentionInterface`` (:func:`use_packed_attention`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PackedCaches", "packed_attention", "run_layers", "use_packed_attention"]

_PREFIX = "pipeline_packed:"


@dataclass
class PackedCaches:
    """The caches and token counts of a micro-batch's sequences, in packed order; passed to the
    layers as their ``past_key_values`` and (as ``packed``) to the attention."""

    caches: list[Any]  # one DynamicCache per sequence
    lengths: list[int]  # new tokens per sequence
    firsts: list[int]  # absolute position of each sequence's first new token
    # A chunk's mask is the same in every layer of one kind (full or sliding): built once.
    masks: dict[tuple, Any] = field(default_factory=dict)

    def mask(self, i: int, inner: str, kv_length: int, window: int | None, query) -> Any:
        """Sequence ``i``'s attention mask (see :func:`_mask`), once per shape and window."""
        key = (i, kv_length, window)
        if key not in self.masks:
            self.masks[key] = _mask(inner, self.firsts[i], self.lengths[i], kv_length, window,
                                    query.dtype, query.device)
        return self.masks[key]

    def update(self, keys, values, layer_idx: int, *_: Any) -> tuple[list[Any], list[Any]]:
        """Append each sequence's new keys and values to its cache; each one's full keys and
        values for this layer (as the cache keeps them: a sliding layer its window only)."""
        all_keys, all_values, start = [], [], 0
        for cache, length in zip(self.caches, self.lengths, strict=True):
            k, v = cache.update(keys[:, :, start:start + length], values[:, :, start:start + length],
                                layer_idx)
            all_keys.append(k)
            all_values.append(v)
            start += length
        return all_keys, all_values


def packed_attention(inner: str, module, query, keys: list[Any], values: list[Any],
                     attention_mask, *, packed: PackedCaches, scaling: float | None = None,
                     sliding_window: int | None = None, **_: Any) -> tuple[Any, None]:
    """Per sequence, its queries against its own keys: ``[1, T, heads, head_dim]``, packed."""
    import torch

    kernel = _kernel(inner, module)
    outputs, start = [], 0
    for i, length in enumerate(packed.lengths):
        query_i = query[:, :, start:start + length]
        mask = packed.mask(i, inner, keys[i].shape[2], sliding_window, query)
        out, _ = kernel(module, query_i, keys[i], values[i], mask, scaling=scaling, dropout=0.0,
                        sliding_window=sliding_window)
        outputs.append(out)
        start += length
    return torch.cat(outputs, dim=1), None


def _kernel(inner: str, module):
    if inner == "eager":  # each model family's own (they agree; softmax in float32)
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _mask(inner: str, first: int, length: int, kv_length: int, window: int | None, dtype,
          device):
    """Which keys each of a sequence's new tokens may see, or None when it may see them all (one
    token: its cache holds exactly what it attends to, a sliding layer its window)."""
    import torch

    if length == 1:
        return None
    end = first + length
    query_pos = torch.arange(first, end, device=device)[:, None]
    key_pos = torch.arange(end - kv_length, end, device=device)[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    if inner == "eager":  # additive, as HF's eager kernel takes it
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
            ~allowed, torch.finfo(dtype).min)[None, None]
    return allowed[None, None]


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


def run_layers(model, hidden, positions, packed: PackedCaches):
    """``model``'s decoder layers (a sliced base model, see ``loading``) over a packed micro-batch
    ``hidden`` ``[1, T, H]`` at absolute ``positions`` ``[T]``; then its norm (Identity on a
    stage)."""
    position_ids = positions[None]
    rotary = model.rotary_emb(hidden, position_ids)
    for layer in model.layers[: model.config.num_hidden_layers]:
        hidden = layer(hidden, attention_mask=None, position_ids=position_ids,
                       past_key_values=packed, use_cache=True, position_embeddings=rotary,
                       packed=packed)
    return model.norm(hidden)

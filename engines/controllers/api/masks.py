"""Token masks as a controller's ``mid_process`` returns them, written into the engine's bias
rows: dense float rows (the seed's shape) or allowed-token bitmasks (beyond the seed)
(``docs/protocols/controller-runtime.md``)."""

from __future__ import annotations

import numpy as np

__all__ = ["apply_allowed", "as_words", "bits_to_bias", "pack_allowed"]

# Byte value → the additive bias of its 8 tokens (bit b of the byte: token 8k + b): a bitmask
# row becomes a dense 0 / -inf row by one table lookup per byte. At batch 16 over a 49,152-token
# vocabulary this took 1.3 ms where shifting the bits out in torch took 5.7 ms (one torch
# thread, as vLLM runs it on CPUs).
_BYTE_BIAS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0.0,
                      -np.inf).astype(np.float32)


def as_words(allowed: np.ndarray) -> np.ndarray:
    """A mask as ``mid_process`` returns it (a bool per id, or llguidance's packed ``int32``
    bitmask: bit ``t % 32`` of word ``t // 32``) as little-endian ``uint32`` words; ids past
    its end are banned (bool masks are padded with zero bits)."""
    allowed = np.asarray(allowed)
    if allowed.dtype == np.bool_:
        packed = np.packbits(allowed, bitorder="little")
        return np.pad(packed, (0, (-len(packed)) % 4)).view("<u4")
    if allowed.dtype in (np.int32, np.uint32):
        return allowed.astype("<u4", copy=False)
    raise TypeError(f"expected bool or int32 bitmask, got {allowed.dtype}")


def pack_allowed(words: np.ndarray, allowed: np.ndarray) -> None:
    """Write ``allowed`` as a bitmask row (:func:`as_words`)."""
    packed = as_words(allowed)
    n = min(len(packed), len(words))
    words[:n] = packed[:n]
    words[n:] = 0


def apply_allowed(row: np.ndarray, allowed: np.ndarray) -> None:
    """Ban (``-inf``) every id ``allowed`` (:func:`as_words`) does not allow in a dense row."""
    bits = np.unpackbits(as_words(allowed).view(np.uint8), bitorder="little").astype(np.bool_)
    n = min(len(bits), len(row))
    row[:n][~bits[:n]] = -np.inf
    row[n:] = -np.inf


def bits_to_bias(words: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Bitmask rows (``uint32`` words, little-endian: bit ``t % 32`` of word ``t // 32``) as
    additive bias rows, ``0`` where allowed and ``-inf`` where banned: ``[rows, 32 * words]``
    float32, written into ``out`` (``[rows, 4 * words, 8]``) when given. This copies, so no view
    of a shared buffer outlives the call."""
    raw = np.ascontiguousarray(words).view(np.uint8)
    if out is None:
        out = np.empty((raw.shape[0], raw.shape[1], 8), np.float32)
    np.take(_BYTE_BIAS, raw, axis=0, out=out)
    return out.reshape(raw.shape[0], -1)

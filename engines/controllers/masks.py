"""Token masks as a controller's ``mid_process`` returns them, written into the engine's bias
rows: dense float rows (the seed's shape) or allowed-token bitmasks (beyond the seed)
(``docs/protocols/controller-runtime.md``)."""

from __future__ import annotations

import numpy as np

__all__ = ["apply_allowed", "as_words", "pack_allowed"]


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

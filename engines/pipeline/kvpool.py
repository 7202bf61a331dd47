"""One stage's keys and values, every live sequence in one tensor per layer (docs/protocols/pipeline.md,
"Batching").

Each layer keeps its keys (and, alike, its values) as ``[slots, kv_heads, head_dim]``: one slot a
token. A sequence owns blocks of ``BLOCK`` slots and a table of its slots by position, so a
micro-batch writes every new token of every sequence in one indexed copy per layer, and its
decode steps read all their keys in one gather. The number of kernels a layer launches no
longer grows with the number of sequences: on a GPU, where each launch costs more than the
arithmetic of one decode step's attention, that is what lets a stage batch.

The pool grows by a quarter at a time and keeps its largest size, at most a quarter (or 64
blocks) above what the sequences held at their peak; the origin's ``KVBudget`` bounds that, up
to the part of a block each sequence leaves unused. A sequence's blocks go back to the pool
when it is cropped or dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BLOCK", "KVPool"]

BLOCK = 16  # slots a sequence takes at a time


@dataclass
class _Slots:
    """A sequence's blocks and, by position, the slot that holds each of its tokens."""

    blocks: list[int]
    table: Any  # LongTensor on the host: blocks * BLOCK + 0..BLOCK-1, in order
    length: int = 0


class KVPool:
    """Slots for ``[1, kv_heads, T, head_dim]`` keys and values, allocated lazily per layer on
    the first write, where the layers compute (their dtype and device)."""

    def __init__(self) -> None:
        self.keys: list[Any] = []  # per layer: [capacity, kv_heads, head_dim]
        self.values: list[Any] = []
        self.capacity = 0  # blocks
        self.free: list[int] = []
        self.seqs: dict[str, _Slots] = {}

    def length(self, seq_id: str) -> int | None:
        """Tokens held for ``seq_id``; None when it holds none (never started, or dropped)."""
        slots = self.seqs.get(seq_id)
        return None if slots is None else slots.length

    def lengths(self) -> dict[str, int]:
        return {seq_id: slots.length for seq_id, slots in self.seqs.items()}

    def start(self, seq_id: str) -> None:
        """``seq_id`` anew, holding nothing (its old blocks, if any, back to the pool)."""
        import torch

        self.drop(seq_id)
        self.seqs[seq_id] = _Slots([], torch.zeros(0, dtype=torch.long))

    def crop(self, seq_id: str, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq_id``; the blocks past them go back."""
        slots = self.seqs[seq_id]
        keep = -(-length // BLOCK)
        self.free.extend(slots.blocks[keep:])
        slots.blocks, slots.table = slots.blocks[:keep], slots.table[:keep * BLOCK]
        slots.length = length

    def drop(self, seq_id: str) -> None:
        slots = self.seqs.pop(seq_id, None)
        if slots is not None:
            self.free.extend(slots.blocks)

    def extend(self, seq_id: str, length: int) -> None:
        """Make room for ``seq_id``'s tokens up to ``length`` (the pool grows if it must)."""
        import torch

        slots = self.seqs[seq_id]
        need = -(-length // BLOCK) - len(slots.blocks)
        if need > len(self.free):
            self._grow(need - len(self.free))
        if need > 0:
            new, self.free = self.free[:need], self.free[need:]
            slots.blocks.extend(new)
            rows = torch.tensor(new, dtype=torch.long)[:, None] * BLOCK + torch.arange(BLOCK)
            slots.table = torch.cat([slots.table, rows.view(-1)])
        slots.length = length

    def table(self, seq_id: str, start: int, end: int):
        """The slots of ``seq_id``'s positions ``[start, end)`` (a host tensor)."""
        return self.seqs[seq_id].table[start:end]

    def _grow(self, at_least: int) -> None:
        # By a quarter (64 blocks at least), not by doubling: the pool keeps its largest size,
        # and that should stay near what the sequences held at their peak.
        grown = self.capacity + max(at_least, self.capacity // 4, 64)
        self.free.extend(range(self.capacity, grown))
        self.capacity = grown  # each layer's tensors follow on their next write

    def write(self, layer: int, keys, values, slots) -> tuple[Any, Any]:
        """Store ``keys``/``values`` ``[1, kv_heads, T, head_dim]`` at ``slots`` ``[T]`` (on
        their device); this layer's whole key and value tensors."""
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        self.keys[layer] = self._sized(self.keys[layer], keys)
        self.values[layer] = self._sized(self.values[layer], values)
        self.keys[layer].index_copy_(0, slots, keys[0].transpose(0, 1))
        self.values[layer].index_copy_(0, slots, values[0].transpose(0, 1))
        return self.keys[layer], self.values[layer]

    def _sized(self, held, like):
        """``held`` grown to the pool's capacity (its slots kept), or new in ``like``'s kind."""
        import torch

        rows = self.capacity * BLOCK
        if held is not None and held.shape[0] == rows:
            return held
        grown = torch.empty((rows, like.shape[1], like.shape[3]), dtype=like.dtype,
                            device=like.device)
        if held is not None:
            grown[: held.shape[0]] = held
        return grown

    def held_bytes(self) -> int:
        """Bytes of the slots that sequences hold now (every layer, keys and values)."""
        per_slot = sum(t[0].numel() * t.element_size() for t in (*self.keys, *self.values)
                       if t is not None)
        return per_slot * BLOCK * sum(len(s.blocks) for s in self.seqs.values())

"""A stage's KV pool (``engines/pipeline/kvpool.py``): blocks a sequence owns and gives back,
slots by position, growth that keeps what was written, and the bytes the sequences hold."""

from __future__ import annotations

import torch

from engines.pipeline.kvpool import BLOCK, KVPool


def _kv(tokens: int, fill: float) -> torch.Tensor:
    """``[1, kv_heads, T, head_dim]`` as HF's attention hands keys to the cache."""
    return torch.full((1, 2, tokens, 4), fill)


def test_a_sequence_takes_whole_blocks_and_its_slots_follow_its_positions():
    pool = KVPool()
    pool.start("a")
    pool.extend("a", BLOCK + 3)
    assert pool.length("a") == BLOCK + 3 and len(pool.seqs["a"].blocks) == 2
    slots = pool.table("a", 0, BLOCK + 3)
    first, second = pool.seqs["a"].blocks
    assert slots[:BLOCK].tolist() == list(range(first * BLOCK, (first + 1) * BLOCK))
    assert slots[BLOCK:].tolist() == list(range(second * BLOCK, second * BLOCK + 3))
    assert pool.length("never") is None


def test_crop_and_drop_give_blocks_back_and_another_sequence_reuses_them():
    pool = KVPool()
    pool.start("a")
    pool.extend("a", 3 * BLOCK)
    free = len(pool.free)
    pool.crop("a", 5)
    assert pool.length("a") == 5 and len(pool.seqs["a"].blocks) == 1
    assert len(pool.free) == free + 2 and pool.table("a", 0, 99).numel() == BLOCK
    pool.drop("a")
    assert len(pool.free) == free + 3 and pool.lengths() == {}
    pool.start("b")
    pool.extend("b", 2 * BLOCK)
    assert pool.capacity == 64 and len(pool.free) == free + 1  # no growth: the blocks came back


def test_start_again_is_a_restart_from_nothing():
    pool = KVPool()
    pool.start("a")
    pool.extend("a", 40)
    pool.start("a")
    assert pool.length("a") == 0 and pool.seqs["a"].blocks == []
    assert len(pool.free) == pool.capacity


def test_growth_keeps_every_written_slot_and_each_layer_follows_on_its_next_write():
    pool = KVPool()
    pool.start("a")
    pool.extend("a", 10)
    keys, values = pool.write(0, _kv(10, 1.0), _kv(10, 2.0), pool.table("a", 0, 10))
    assert keys.shape == (64 * BLOCK, 2, 4) and keys.dtype == torch.float32
    written = pool.table("a", 0, 10)
    pool.start("b")
    pool.extend("b", 64 * BLOCK)  # more than is free: the pool grows (by 64 blocks at least)
    assert pool.capacity == 128
    keys, values = pool.write(0, _kv(1, 3.0), _kv(1, 4.0), pool.table("b", 0, 1))
    assert keys.shape[0] == 128 * BLOCK
    assert torch.equal(keys[written], torch.ones(10, 2, 4))
    assert torch.equal(values[written], torch.full((10, 2, 4), 2.0))
    assert torch.equal(keys[pool.table("b", 0, 1)], torch.full((1, 2, 4), 3.0))


def test_held_bytes_count_the_blocks_the_sequences_hold_in_every_layer():
    pool = KVPool()
    pool.start("a")
    pool.extend("a", 3)
    assert pool.held_bytes() == 0  # nothing written yet: no layer has a tensor
    for layer in range(2):
        pool.write(layer, _kv(3, 0.0), _kv(3, 0.0), pool.table("a", 0, 3))
    per_slot = 2 * 4 * 4  # kv_heads * head_dim * float32
    assert pool.held_bytes() == 2 * 2 * per_slot * BLOCK  # layers * (keys, values) * one block
    pool.drop("a")
    assert pool.held_bytes() == 0

"""bench/adapters.py's pairing: passes run ABBA, and each pair of passes is one reading."""

from __future__ import annotations

import pytest

from bench import adapters


def _rows(values: list[tuple[str, float]]) -> list[dict]:
    return [{"pass": i, "load": load, "output_throughput": v} for i, (load, v) in
            enumerate(values)]


def test_each_pair_of_passes_is_one_rotation_over_base_reading():
    rows = _rows([("base", 100.0), ("rotation", 90.0), ("rotation", 80.0), ("base", 100.0)])
    assert adapters.readings(rows, "output_throughput") == pytest.approx([0.9, 0.8])


def test_a_run_cut_short_reads_only_its_whole_pairs():
    rows = _rows([("base", 100.0), ("rotation", 90.0), ("rotation", 80.0)])
    assert adapters.readings(rows, "output_throughput") == pytest.approx([0.9])

"""bench/tenancy.py's report: each round's ratios one reading, per gate."""

from __future__ import annotations

import argparse

from bench import tenancy


def test_each_round_is_one_reading_of_each_ratio_per_gate():
    rows = [{"gate": gate, "round": i, "alone": 10.0, "flood": 10.0 * (1.1 + i / 10),
             "idle": 20.0, "batch": 24.0, "flood_tokens_s": 100.0}
            for gate in ("16/4", "off") for i in range(3)]
    rows.insert(0, {**rows[0], "round": -1, "alone": 50.0})  # the warm-up: listed, not pooled
    args = argparse.Namespace(rounds=3, flood=64, batch_lines=256, gates="16/4,off",
                              client="normal")
    text = tenancy.report(rows, args)
    assert "gate 16/4, flood / alone: 1.2" in text and "gate off, batch / idle: 1.2" in text
    assert text.count("| 16/4 |") == 4 and "| 16/4 | warm-up | 50.0 |" in text

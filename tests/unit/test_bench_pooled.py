"""bench/pooled.py: readings pooled into one figure, the rule for every bar in
docs/benchmarks.md."""

from __future__ import annotations

import pytest

from bench.pooled import pool


def test_the_mean_its_standard_error_and_the_t_interval():
    got = pool([1.0, 1.1, 0.9])
    assert got.mean == pytest.approx(1.0)
    assert got.error == pytest.approx(0.1 / 3 ** 0.5)
    assert (got.low, got.high) == pytest.approx((1.0 - 4.303 * got.error, 1.0 + 4.303 * got.error))
    assert "3 readings" in got.text()


def test_a_bar_is_met_missed_or_not_shown_either_way():
    assert pool([1.10, 1.12, 1.11, 1.13]).meets(1.05) is True
    assert pool([0.90, 0.91, 0.92]).meets(0.95) is False
    assert pool([0.90, 1.00, 1.05]).meets(0.95) is None  # the interval straddles the bar
    assert pool([0.60, 0.62, 0.61]).meets(0.7, above=False) is True  # "at most" bars
    assert pool([1.2]).meets(1.0) is None  # one reading: no spread to tell


def test_no_readings_is_an_error():
    with pytest.raises(ValueError):
        pool([])

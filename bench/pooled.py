"""Readings pooled into one figure: the rule for every bar in docs/benchmarks.md. Each run (or
round, or pair of neighbouring loads) gives one reading, usually a ratio of two targets measured
in the same run; all of them count, none dropped. The figure is their mean, with its standard
error and a 95 % Student-t interval; a bar the interval straddles is "not shown either way"."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import msgspec

__all__ = ["Pooled", "pool"]

# Student's t, 97.5th percentile, by degrees of freedom (1-30); beyond, the normal's 1.96 is
# within 2 % of it.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


class Pooled(msgspec.Struct, frozen=True, kw_only=True):
    """``readings`` pooled: their ``mean``, its standard ``error``, the 95 % interval
    [``low``, ``high``] (None with a single reading: no spread to tell)."""

    readings: tuple[float, ...]
    mean: float
    error: float | None
    low: float | None
    high: float | None

    def meets(self, bar: float, above: bool = True) -> bool | None:
        """Whether the interval lies on the bar's good side (True), its bad side (False), or
        straddles it (None: not shown either way)."""
        if self.low is None or self.high is None:
            return None
        if (self.low >= bar) if above else (self.high <= bar):
            return True
        if (self.high < bar) if above else (self.low > bar):
            return False
        return None

    def text(self, unit: str = "x") -> str:
        if self.error is None:
            return f"{self.mean:.3f}{unit} (one reading)"
        return (f"{self.mean:.3f}{unit} (standard error {self.error:.3f}, 95 % interval "
                f"{self.low:.3f}-{self.high:.3f}, {len(self.readings)} readings)")


def pool(readings: Sequence[float]) -> Pooled:
    values = tuple(float(r) for r in readings)
    if not values:
        raise ValueError("no readings to pool")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Pooled(readings=values, mean=mean, error=None, low=None, high=None)
    error = statistics.stdev(values) / len(values) ** 0.5
    t = _T975[min(len(values) - 1, len(_T975)) - 1] if len(values) - 1 <= len(_T975) else 1.96
    return Pooled(readings=values, mean=mean, error=error, low=mean - t * error,
                  high=mean + t * error)

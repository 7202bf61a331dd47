"""``ray.util.metrics`` as a test records it: a stand-in module whose series keep what they
were given (the real one: tests/e2e/test_observability_e2e.py, through a real Prometheus)."""

from __future__ import annotations

from collections import defaultdict

from engines.kit.telemetry import Levels
from gateway.ingress.telemetry import GatewayMetrics


class Recorded:
    """``ray.util.metrics`` in memory: ``counts[name][tags]``, ``observed[name][tags]``,
    ``levels[name][tags]`` (tags as sorted item tuples)."""

    def __init__(self):
        self.keeper = Levels(refresh_s=None)  # no thread: a test calls keeper.refresh()
        self.counts = defaultdict(lambda: defaultdict(float))
        self.observed = defaultdict(lambda: defaultdict(list))
        self.levels = defaultdict(dict)
        recorder = self

        class Series:
            def __init__(self, name, description="", tag_keys=(), boundaries=None):
                assert description and name.startswith("llm_gateway_")
                self.name, self.tag_keys = name, tuple(tag_keys)

            def _key(self, tags):
                assert set(tags or {}) == set(self.tag_keys), (self.name, tags)
                return tuple(sorted((tags or {}).items()))

            def inc(self, value=1.0, tags=None):
                recorder.counts[self.name][self._key(tags)] += value

            def observe(self, value, tags=None):
                recorder.observed[self.name][self._key(tags)].append(value)

            def set(self, value, tags=None):
                recorder.levels[self.name][self._key(tags)] = value

        self.Counter = self.Gauge = self.Histogram = Series

    def count(self, name: str, **tags) -> float:
        """The sum over every series of ``name`` whose tags include ``tags``."""
        return sum(value for key, value in self.counts[name].items()
                   if set(tags.items()) <= set(key))

    def observations(self, name: str, **tags) -> list[float]:
        return [v for key, values in self.observed[name].items()
                if set(tags.items()) <= set(key) for v in values]

    def level(self, name: str, **tags) -> float:
        """The sum of the levels of ``name`` whose tags include ``tags``."""
        return sum(value for key, value in self.levels[name].items()
                   if set(tags.items()) <= set(key))

    def metrics(self) -> GatewayMetrics:
        return GatewayMetrics(self, self.keeper)

"""The series this project exports through Ray's metrics system (docs/observability.md).

A replica or actor records into ``ray.util.metrics``; Ray's metrics agent on each node exports
what every process of that node recorded (names prefixed ``ray_``, each process's series tagged
with its ``WorkerId``), so Prometheus scraping every node's agent sees every replica, and a
cluster-wide figure is a ``sum`` over them. A per-replica registry behind one HTTP port cannot do
that: a scrape would land on one replica at random. Outside a Ray worker the calls do nothing.

Series are built once per process (:func:`series`); tests inject a recording stand-in for the
``ray.util.metrics`` module.
"""

from __future__ import annotations

import bisect
import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

__all__ = ["BATCH_BUCKETS_S", "LATENCY_BUCKETS_S", "STEP_BUCKETS_S", "TOKEN_GAP_BUCKETS_S",
           "LEVELS", "CountedHistogram", "EngineMetrics", "Levels", "Tally", "engine_metrics",
           "ray_metrics"]

# Seconds. Wide enough for a 2-core CPU box (a first token after seconds of queueing) and fine
# enough for a GPU (tens of milliseconds).
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                     80.0, 160.0, 320.0)
# Between two tokens of one stream: a GPU's few milliseconds to a loaded CPU's tenths of seconds.
TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
                       0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
# A pipeline micro-batch's way through every stage and back.
BATCH_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A controller runtime's work for one engine step (all of its sequences' controllers).
STEP_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                  0.5, 1.0)

ENGINE_TAGS = ("model", "engine")
STAGE_TAGS = ("model", "stage")  # a pipeline's stage: its index and layer range, "1:10-20"


class EngineMetrics:
    """The engine side's series: what a replica runs, each engine kind's own figures."""

    def __init__(self, make: Any, levels: Levels | None = None):
        self.active = make.Gauge(
            "llm_gateway_engine_requests_active",
            description="Generations admitted by an engine replica and not yet finished.",
            tag_keys=ENGINE_TAGS)
        self.reasoning_tokens = make.Counter(
            "llm_gateway_reasoning_tokens",
            description="Tokens a reasoning model spent thinking, its end marker included "
                        "(docs/reasoning.md).", tag_keys=ENGINE_TAGS)
        self.pipeline_batch = make.Histogram(
            "llm_gateway_pipeline_batch_seconds",
            description="A pipeline micro-batch's round trip through every stage (seconds).",
            boundaries=list(BATCH_BUCKETS_S), tag_keys=("model",))
        self.pipeline_batch_tokens = make.Counter(
            "llm_gateway_pipeline_batch_tokens",
            description="Token positions a pipeline's micro-batches carried through its stages.",
            tag_keys=("model",))
        self.pipeline_stage = make.Histogram(
            "llm_gateway_pipeline_stage_seconds",
            description="One stage's forward over one micro-batch (seconds).",
            boundaries=list(BATCH_BUCKETS_S), tag_keys=STAGE_TAGS)
        def series(kind: str, name: str, description: str,
                   tag_keys: tuple[str, ...] = ("model",)) -> Any:
            return getattr(make, kind)(f"llm_gateway_{name}", description=description,
                                       tag_keys=tag_keys)

        self.pipeline_stage_kv_bytes = series(
            "Gauge", "pipeline_stage_kv_bytes", "Bytes of keys and values a stage's caches hold.",
            STAGE_TAGS)
        self.pipeline_stage_kv_tokens = series(
            "Gauge", "pipeline_stage_kv_tokens",
            "Token positions a stage's caches hold, every sequence.", STAGE_TAGS)
        self.pipeline_stage_sequences = series(
            "Gauge", "pipeline_stage_sequences", "Sequences with a cache on a stage.", STAGE_TAGS)
        self.pipeline_restarts = series(
            "Counter", "pipeline_restarts",
            "Times a pipeline's sequences were re-run after a stage failed.")
        # vLLM's own figures, sampled (engines/vllm/stats.py).
        self.vllm_running = series("Gauge", "vllm_requests_running", "Requests vLLM runs now.")
        self.vllm_waiting = series("Gauge", "vllm_requests_waiting",
                                   "Requests waiting in vLLM.")
        self.vllm_kv_cache_usage = series("Gauge", "vllm_kv_cache_usage",
                                          "Fraction of vLLM's KV cache in use (0-1).")
        self.vllm_prompt_tokens = series("Counter", "vllm_prompt_tokens",
                                         "Prompt tokens vLLM took.")
        self.vllm_generation_tokens = series("Counter", "vllm_generation_tokens",
                                             "Tokens vLLM generated.")
        self.vllm_finished = series("Counter", "vllm_requests_finished",
                                    "Requests vLLM finished.")
        self.vllm_prefix_cache_queries = series(
            "Counter", "vllm_prefix_cache_queries",
            "Prompt tokens vLLM looked up in its prefix cache.")
        self.vllm_prefix_cache_hits = series(
            "Counter", "vllm_prefix_cache_hits",
            "Prompt tokens vLLM found in its prefix cache (hits / queries: its hit rate).")
        # Counted where a replica is picked: the gateway's ingress replicas and each model's
        # ingress request router (engines/caller/prefix_router.py, docs/routing.md).
        self.routing_picks = series(
            "Counter", "routing_picks", "Replicas picked by prefix-aware routing, by reason "
            "(prefix: it holds the prompt's longest known prefix; load: the least loaded).",
            ("model", "reason"))
        # Counted in the controller runtime's process, handed over by its replica
        # (engines/controllers/runtime/service.py): a histogram of tallies, not of observations.
        self.controller_step = CountedHistogram(
            make, "llm_gateway_controller_step_seconds",
            "A controller runtime's work for one engine step (seconds).", STEP_BUCKETS_S,
            ("model",), levels or LEVELS)
        self.controller_timeouts = make.Counter(
            "llm_gateway_controller_timeouts",
            description="Controller calls cut at their time bound, by kind (mid: mask; "
            "pre_post: before and after sampling).", tag_keys=("model", "kind"))


class Levels:
    """This process's gauge levels, handed to Ray every ``refresh_s`` seconds.

    Ray exports a gauge only while its process keeps setting it: its metrics agent forgets a
    gauge not set within two report intervals, so a replica that sat idle would vanish from
    a gauge's sum instead of reporting 0. Levels are kept here and set by one daemon thread.
    A change is only recorded where it happens (two per request for the in-flight gauges):
    Ray reports a gauge's last value every few seconds, so setting it at once showed nothing
    more and cost a Ray call each (docs/results/benchmarks-2026-12-07.md, "Placement on a fast engine, and a
    request's own cost in the replica").
    """

    def __init__(self, refresh_s: float | None = 1.0):
        self.refresh_s = refresh_s  # None: no thread; whoever made it calls refresh()
        self._levels: dict[tuple[int, tuple[str, ...]], tuple[Any, dict[str, str], float]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._exporters: list[Callable[[], None]] = []

    def export_with_levels(self, export: Callable[[], None]) -> None:
        """Call ``export`` (it sets gauges) every ``refresh_s`` seconds, with the levels."""
        with self._lock:
            self._exporters.append(export)
            self._start()

    def stop_exporting(self, export: Callable[[], None]) -> None:
        """``export`` is not called again (its owner closed)."""
        with self._lock:
            if export in self._exporters:
                self._exporters.remove(export)

    def _start(self) -> None:
        if self._thread is None and self.refresh_s is not None:
            self._thread = threading.Thread(target=self._refresh, args=(self.refresh_s,),
                                            daemon=True, name="metrics-levels")
            self._thread.start()

    def set(self, gauge: Any, tags: dict[str, str], value: float) -> None:
        self._put(gauge, tags, lambda _: value)

    def add(self, gauge: Any, tags: dict[str, str], change: float) -> None:
        """Move the level of ``gauge`` for ``tags`` by ``change``."""
        self._put(gauge, tags, lambda level: level + change)

    def _put(self, gauge: Any, tags: dict[str, str], new: Callable[[float], float]) -> None:
        key = (id(gauge), tuple(tags.values()))
        with self._lock:
            value = new(self._levels[key][2] if key in self._levels else 0)
            self._levels[key] = (gauge, tags, value)
            self._start()

    def _refresh(self, every_s: float) -> None:
        while True:
            time.sleep(every_s)
            self.refresh()

    def refresh(self) -> None:
        """Set every level again and run every exporter (the thread's work, once)."""
        with self._lock:
            levels = list(self._levels.values())
            exporters = list(self._exporters)
        for gauge, tags, value in levels:
            gauge.set(value, tags=tags)
        for export in exporters:
            export()


class Tally(msgspec.Struct):
    """Values counted into a histogram's buckets: ``counts[i]`` values fell at or below
    ``boundaries[i]`` and above the bound before it, the last count past every bound; ``total``
    is their sum. One process counts, another may take the tally whole (a controller runtime's
    process hands its step times to its replica) and add it to its own."""

    counts: list[int]
    total: float = 0.0

    @classmethod
    def empty(cls, boundaries: tuple[float, ...]) -> Tally:
        return cls([0] * (len(boundaries) + 1))

    def count(self, values: Iterable[float], boundaries: tuple[float, ...]) -> None:
        counts = self.counts
        for value in values:
            counts[bisect.bisect_left(boundaries, value)] += 1
            self.total += value

    def add(self, other: Tally) -> None:
        if len(other.counts) != len(self.counts):
            raise ValueError("tallies over different buckets")
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total

    def since(self, earlier: Tally) -> Tally:
        """What was counted after ``earlier`` (a copy of this tally taken then)."""
        return Tally([a - b for a, b in zip(self.counts, earlier.counts, strict=True)],
                     self.total - earlier.total)


class CountedHistogram:
    """A histogram counted in this process and handed to Ray as gauges: its cumulative
    ``<name>_bucket`` (tag ``le``), ``<name>_count`` and ``<name>_sum``, set again with the
    levels every second from its first value on. In Prometheus they read as a histogram's
    series do (``histogram_quantile`` over ``rate`` of the buckets).

    For what is observed once per generated token. Ray's ``Histogram`` costs about 5 µs an
    observation in the process, and its metrics agent then replays every observation counted
    (one more call each): most of what the metrics added per token, until counted here
    (docs/observability.md). Counting here is a bisect and two additions per value.
    """

    def __init__(self, make: Any, name: str, description: str, boundaries: tuple[float, ...],
                 tag_keys: tuple[str, ...], levels: Levels):
        self.boundaries = boundaries
        self._bounds = [*(repr(float(b)) for b in boundaries), "+Inf"]
        self._buckets = make.Gauge(f"{name}_bucket", description=f"{description} Cumulative "
                                   "count of values up to le.", tag_keys=(*tag_keys, "le"))
        self._count = make.Gauge(f"{name}_count", description=f"{description} Count.",
                                 tag_keys=tag_keys)
        self._sum = make.Gauge(f"{name}_sum", description=f"{description} Sum.",
                               tag_keys=tag_keys)
        self._counted: dict[tuple[str, ...], tuple[dict[str, str], Tally]] = {}
        self._lock = threading.Lock()
        self._levels = levels  # exported from the first value on: a process that never
        # counts (a pipeline stage, for this one) starts no thread for it

    def observe_all(self, values: list[float], tags: dict[str, str]) -> None:
        """Count ``values`` (e.g. one generation's gaps between tokens) under ``tags``."""
        with self._lock:
            self._tally(tags).count(values, self.boundaries)

    def add(self, tally: Tally, tags: dict[str, str]) -> None:
        """Add what another process counted over the same boundaries."""
        with self._lock:
            self._tally(tags).add(tally)

    def _tally(self, tags: dict[str, str]) -> Tally:
        counted = self._counted.get(key := tuple(tags.values()))
        if counted is None:
            if not self._counted:
                self._levels.export_with_levels(self.export)
            counted = self._counted[key] = (dict(tags), Tally.empty(self.boundaries))
        return counted[1]

    def export(self) -> None:
        """Hand the counts so far to Ray."""
        with self._lock:
            counted = [(tags, list(tally.counts), tally.total) for tags, tally
                       in self._counted.values()]
        for tags, counts, total in counted:
            cumulative = 0
            for bound, count in zip(self._bounds, counts, strict=True):
                cumulative += count
                self._buckets.set(cumulative, tags={**tags, "le": bound})
            self._count.set(cumulative, tags=tags)
            self._sum.set(total, tags=tags)


LEVELS = Levels()


class _Unrecorded:
    """Series that record nothing: where Ray is not installed (the pipeline's stages on a
    machine of their own, docs/protocols/pipeline.md)."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def inc(self, *args: Any, **kwargs: Any) -> None:
        pass

    set = observe = inc


class _NoMetrics:
    Counter = Gauge = Histogram = _Unrecorded


def ray_metrics() -> Any:
    """``ray.util.metrics``, or series that record nothing where Ray is not installed."""
    try:
        from ray.util import metrics
    except ImportError:
        return _NoMetrics
    return metrics


@functools.cache
def engine_metrics() -> EngineMetrics:
    """This process's engine series, through Ray's metrics system."""
    return EngineMetrics(ray_metrics())

"""Typed configuration of one served model (validated with msgspec)."""

from __future__ import annotations

from typing import Any

import msgspec

from engines.embedded import EMBEDDED_MODEL_NAME, local_model_dir
from engines.kinds import ENGINE_CONCURRENCY, ENGINE_KINDS, check_engine_args

__all__ = ["ModelConfig"]


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One model the gateway serves.

    ``engine``: the engine kind serving it (``engines.kinds.ENGINE_KINDS``).
    ``source``: ``embedded:smollm2-135m-instruct`` or a local Hugging Face model directory.
    ``engine_args``: the kind's own options (``vllm``: ``AsyncEngineArgs`` on top of
    ``engines.vllm.args.DEFAULT_ENGINE_ARGS``; ``pipeline``: ``engines.pipeline.config.
    PipelineArgs``, checked here).
    ``num_cpus``: Ray CPUs reserved per replica; fractional so small boxes can schedule it
    (vLLM's own threads are bound by its CPU backend, not by this number).
    ``max_ongoing_requests``: requests one replica holds at once (default: twice the sequences
    the engine batches, ``engines.kinds.ENGINE_CONCURRENCY``, so the engine's own queue stays
    short). ``max_queued_requests``: requests each ingress replica queues for this model beyond
    that (default: as many as ongoing); more are refused as overloaded (429/503 in the
    protocol's shape) instead of waiting without bound. ``-1``: unbounded (Serve's default).
    """

    name: str = EMBEDDED_MODEL_NAME
    engine: str = "vllm"
    source: str = f"embedded:{EMBEDDED_MODEL_NAME}"
    engine_args: dict[str, Any] = {}
    num_replicas: int = 1
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    max_ongoing_requests: int | None = None
    max_queued_requests: int | None = None
    # How often Serve's controller health-checks each replica (Serve's default: 10 s). A dead
    # replica is noticed no sooner, and until then requests wait for it in Serve's router.
    health_check_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("model name must not be empty")
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be >= 1")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < -1:
            raise ValueError("max_queued_requests must be >= 0, or -1 for unbounded")
        if not self.health_check_period_s > 0:
            raise ValueError("health_check_period_s must be positive")
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"model {self.name!r}: unknown engine kind {self.engine!r}; "
                             f"known: {sorted(ENGINE_KINDS)}")
        try:
            check_engine_args(self, local_model_dir(self.source))
        except ValueError as exc:
            raise ValueError(f"model {self.name!r}: {exc}") from None

    def ongoing_limit(self) -> int:
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        option, default = ENGINE_CONCURRENCY[self.engine]
        return 2 * int(self.engine_args.get(option) or default)

    def pending_limit(self) -> int | None:
        """Generations one ingress replica sends this model at most: what its replicas hold
        plus the queue (None: unbounded)."""
        if self.queue_limit() < 0:
            return None
        return self.ongoing_limit() * self.num_replicas + self.queue_limit()

    def queue_limit(self) -> int:
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return self.ongoing_limit()

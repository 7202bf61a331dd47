"""Typed configuration of one served model (validated with msgspec)."""

from __future__ import annotations

from typing import Any

import msgspec

from engines.embedded import EMBEDDED_MODEL_NAME

__all__ = ["DEFAULT_ENGINE_ARGS", "ModelConfig"]

# Chosen for the 2-core / CPU case and harmless on a GPU: vLLM's CPU backend sizes its KV cache
# from gpu_memory_utilization against the NUMA node, and 0.92 fails on small nodes.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 2048,
    "gpu_memory_utilization": 0.5,
    # MindIE/LMI send per-request priorities; vLLM rejects them unless this policy is on.
    "scheduling_policy": "priority",
}


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One model the gateway serves.

    ``source``: ``embedded:smollm2-135m-instruct`` or a local Hugging Face model directory.
    ``engine_args``: passed to vLLM's ``AsyncEngineArgs`` on top of :data:`DEFAULT_ENGINE_ARGS`.
    ``num_cpus``: Ray CPUs reserved per replica; fractional so small boxes can schedule it
    (vLLM's own threads are bound by its CPU backend, not by this number).
    """

    name: str = EMBEDDED_MODEL_NAME
    source: str = f"embedded:{EMBEDDED_MODEL_NAME}"
    engine_args: dict[str, Any] = {}
    num_replicas: int = 1
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    max_ongoing_requests: int = 256

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("model name must not be empty")
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be >= 1")

    def merged_engine_args(self) -> dict[str, Any]:
        return {**DEFAULT_ENGINE_ARGS, **self.engine_args}

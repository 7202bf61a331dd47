"""Typed configuration of one served model (validated with msgspec)."""

from __future__ import annotations

from typing import Any

import msgspec

from engines.embedded import EMBEDDED_MODEL_NAME, local_model_dir
from engines.kinds import ENGINE_KINDS, check_engine_args

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
    """

    name: str = EMBEDDED_MODEL_NAME
    engine: str = "vllm"
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
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"model {self.name!r}: unknown engine kind {self.engine!r}; "
                             f"known: {sorted(ENGINE_KINDS)}")
        try:
            check_engine_args(self, local_model_dir(self.source))
        except ValueError as exc:
            raise ValueError(f"model {self.name!r}: {exc}") from None

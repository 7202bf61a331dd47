"""Engine kinds: the name a model entry gives in ``engine:`` → the class that implements it.

Classes are named by import path and imported only when a replica starts, so validating a
config never imports vLLM (or torch). Each class is built with ``cls(config)``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.base import Engine
    from engines.config import ModelConfig

__all__ = ["ENGINE_ARG_CHECKS", "ENGINE_CONCURRENCY", "ENGINE_KINDS", "check_engine_args", "create_engine"]

ENGINE_KINDS: dict[str, str] = {
    "vllm": "engines.vllm.engine:VLLMEngine",
    "pipeline": "engines.pipeline.engine:PipelineEngine",
}

# Per kind, the engine argument that says how many sequences it batches, and its default
# (vLLM's SchedulerConfig default; the pipeline's max_sequences): replica limits derive from it.
ENGINE_CONCURRENCY: dict[str, tuple[str, int]] = {
    "vllm": ("max_num_seqs", 128),
    "pipeline": ("max_sequences", 8),
}

# Per kind, a check of its ``engine_args`` run when the config is loaded (``serve run``), so a
# bad option fails there rather than in a replica. Called as ``check(engine_args, local_dir)``,
# ``local_dir`` being the model directory when it is readable here (else None). Must not import
# the engine itself (torch, vLLM).
ENGINE_ARG_CHECKS: dict[str, str] = {
    "pipeline": "engines.pipeline.config:check_engine_args",
}


def create_engine(config: ModelConfig) -> Engine:
    module, _, name = ENGINE_KINDS[config.engine].partition(":")
    return getattr(importlib.import_module(module), name)(config)


def check_engine_args(config: ModelConfig, local_dir: str | None) -> None:
    """Raise ValueError when ``config.engine_args`` are wrong for its kind."""
    check = ENGINE_ARG_CHECKS.get(config.engine)
    if check is not None:
        module, _, name = check.partition(":")
        getattr(importlib.import_module(module), name)(config.engine_args, local_dir)

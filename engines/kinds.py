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

__all__ = ["ENGINE_KINDS", "create_engine"]

ENGINE_KINDS: dict[str, str] = {
    "vllm": "engines.vllm.engine:VLLMEngine",
}


def create_engine(config: ModelConfig) -> Engine:
    module, _, name = ENGINE_KINDS[config.engine].partition(":")
    return getattr(importlib.import_module(module), name)(config)

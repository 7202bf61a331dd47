"""Engine kinds: the name a model entry gives in ``engine:`` → one :class:`EngineKind` entry.

Classes are named by import path and imported only when a replica starts, so validating a
config never imports vLLM (or torch). Each class is built with ``cls(config)``. Adding a kind is
one entry in :data:`ENGINE_KINDS` (the README's "Add an engine kind").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Literal

import msgspec

from engines.kit import placement

if TYPE_CHECKING:
    from engines.kit.base import Engine
    from engines.kit.config import ModelConfig

__all__ = ["ENGINE_KINDS", "EngineKind", "check_engine_args", "create_engine", "kind_of"]


class EngineKind(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the gateway needs to know about one engine kind before importing it."""

    # ``module:Class`` of the engine (an ``engines.kit.base.Engine``), imported in the replica.
    implementation: str
    # The engine argument that says how many sequences it batches, and that argument's default:
    # replica limits derive from it (ModelConfig.ongoing_limit).
    concurrency_arg: str
    default_concurrency: int
    # ``module:function`` checking the kind's ``engine_args`` when the config is loaded (``serve
    # run``), so a bad option fails there rather than in a replica; called as
    # ``check(engine_args, local_dir)``, ``local_dir`` the model directory when readable here
    # (else None). Must not import the engine itself (torch, vLLM).
    arg_check: str | None = None
    # Hosts AICI-style controllers (ModelConfig.controllers defaults on, docs/controllers.md).
    runs_controllers: bool = False
    # Serves LoRA adapters (ModelConfig.lora, GenerateRequest.adapter; docs/adapters.md).
    serves_adapters: bool = False
    # Where its compute runs, which decides the placement step of its start (engines/kit/placement.py):
    # "own_worker", a worker process that pins cores of its own (vLLM on CPU: the node's serving
    # processes move off them once it is up); "replica", the replica's own process (it keeps
    # every CPU it claimed).
    computes_in: Literal["own_worker", "replica"] = "replica"


ENGINE_KINDS: dict[str, EngineKind] = {
    # vLLM's SchedulerConfig default batch.
    "vllm": EngineKind(implementation="engines.vllm.engine:VLLMEngine",
                       concurrency_arg="max_num_seqs", default_concurrency=128,
                       runs_controllers=True, serves_adapters=True,
                       computes_in="own_worker"),
    # PipelineArgs.max_sequences' default (a unit test holds them equal).
    "pipeline": EngineKind(implementation="engines.pipeline.engine:PipelineEngine",
                           concurrency_arg="max_sequences", default_concurrency=16,
                           arg_check="engines.pipeline.config:check_engine_args",
                           runs_controllers=True),
}


def kind_of(config: ModelConfig) -> EngineKind:
    """The entry of ``config.engine``; ValueError naming the known kinds if there is none."""
    kind = ENGINE_KINDS.get(config.engine)
    if kind is None:
        raise ValueError(f"model {config.name!r}: unknown engine kind {config.engine!r}; "
                         f"known: {sorted(ENGINE_KINDS)}")
    return kind


def _named(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def create_engine(config: ModelConfig) -> Engine:
    """The engine of ``config``'s kind, started inside the placement step (imported inside it
    too: the step widens this process's CPUs before torch sizes its thread pool)."""
    kind = kind_of(config)
    with placement.engine_start(config.name, pins_own_worker=kind.computes_in == "own_worker"):
        return _named(kind.implementation)(config)


def check_engine_args(config: ModelConfig, local_dir: str | None) -> None:
    """Raise ValueError when ``config.engine_args`` are wrong for its kind."""
    check = kind_of(config).arg_check
    if check is not None:
        _named(check)(config.engine_args, local_dir)

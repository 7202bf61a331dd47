"""A controller runtime serving one engine's channels: in a Ray actor beside the engine replica,
or on threads of the calling process (no Ray: tests, a bare engine).

The replica creates the shm objects (``ChannelObjects``) and starts this before vLLM: the
engine hook asks ``tokens`` while vLLM builds its logits processors.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

from engines.controllers.builtin import BUILTIN_CONTROLLERS, HFTokenizerInfo
from engines.controllers.channels import MainServer, SideServer
from engines.controllers.runtime import ControllerFactory, ControllerRuntime, Limits
from engines.controllers.shm import BiasMatrix

__all__ = ["RuntimeService", "load_controllers", "start_runtime"]

log = logging.getLogger(__name__)


def load_controllers(custom: Mapping[str, str]) -> dict[str, ControllerFactory]:
    """The built-ins plus the operator's ``{tag: "package.module:Class"}`` (trusted code; the
    shape is checked where the config is, ``engines.config.Controllers``)."""
    controllers: dict[str, ControllerFactory] = dict(BUILTIN_CONTROLLERS)
    for tag, path in custom.items():
        module, _, name = path.partition(":")
        controllers[tag] = getattr(importlib.import_module(module), name)
    return controllers


class RuntimeService:
    """Both channels served on daemon threads until :meth:`close`."""

    def __init__(self, prefix: str, model_dir: str, vocab_size: int,
                 custom: Mapping[str, str] | None = None, limits: Limits | None = None) -> None:
        tokenizer = HFTokenizerInfo.from_pretrained(model_dir, vocab_size)
        _ = tokenizer.llg  # built now (~1 s on a large vocabulary), not in a request's init bound
        self._bias = BiasMatrix(prefix, create=False)
        self.runtime = ControllerRuntime(tokenizer, load_controllers(custom or {}), self._bias,
                                         limits or Limits())
        self._main, self._side = MainServer(prefix), SideServer(prefix)
        self._threads = [
            threading.Thread(target=self._main.serve, args=(self.runtime.handle_main,),
                             name="aici-main", daemon=True),
            threading.Thread(target=self._side.serve, args=(self.runtime.handle_side,),
                             name="aici-side", daemon=True)]
        for thread in self._threads:
            thread.start()

    def ready(self) -> int:
        return self.runtime.tokenizer.vocab_size

    def close(self) -> None:
        self._main.close()
        self._side.close()
        for thread in self._threads:
            thread.join(5)
        self.runtime.close()
        self._bias.close()


def start_runtime(prefix: str, model_dir: str, vocab_size: int, custom: Mapping[str, str],
                  limits: Limits) -> Any:
    """A :class:`RuntimeService` in a Ray actor pinned to this node when Ray runs here (its
    controllers' CPU time then is not the replica's), else on this process's threads. Returns
    an object with ``close()``; the actor dies with its owner, the replica."""
    import ray

    if not ray.is_initialized():
        return RuntimeService(prefix, model_dir, vocab_size, custom, limits)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    actor_cls = ray.remote(num_cpus=0)(RuntimeService)
    actor = actor_cls.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        name=None, max_restarts=0).remote(prefix, model_dir, vocab_size, dict(custom), limits)
    ray.get(actor.ready.remote(), timeout=120)
    return _ActorHandle(actor)


class _ActorHandle:
    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def close(self) -> None:
        import ray

        try:
            ray.get(self._actor.close.remote(), timeout=10)
        except Exception as exc:  # gone already: the shm objects are the owner's to remove
            log.debug("controller runtime actor: %s", exc)
        ray.kill(self._actor)

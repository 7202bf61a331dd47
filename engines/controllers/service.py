"""A controller runtime serving one engine's channels: in a Ray actor beside the engine replica,
or on threads of the calling process (no Ray: tests, a bare engine).

The replica creates the shm objects (``ChannelObjects``) and starts this before vLLM: the
engine hook asks ``tokens`` while vLLM builds its logits processors.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from engines.controllers.builtin import BUILTIN_CONTROLLERS, HFTokenizerInfo
from engines.controllers.channels import MainServer, SideClient, SideServer
from engines.controllers.messages import TagList, read
from engines.controllers.runtime import ControllerFactory, ControllerRuntime, Limits
from engines.controllers.shm import BiasMatrix, ChannelObjects
from protocols.internal import ControllerTag

__all__ = ["AttachedRuntime", "RuntimeService", "attach_runtime", "close_quietly",
           "load_controllers", "start_runtime"]

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

        if not ray.is_initialized():  # Ray's shutdown ended the actor; a call now would
            return  # start a new local Ray instance (at interpreter exit, say)
        try:
            ray.get(self._actor.close.remote(), timeout=10)
        except Exception as exc:  # gone already: the shm objects are the owner's to remove
            log.debug("controller runtime actor: %s", exc)
        ray.kill(self._actor)


class AttachedRuntime:
    """An engine replica's controller runtime, as the replica holds it: the shared-memory
    objects it made (``prefix`` names them for the processes that open their ends), the runtime
    serving them, and the side channel's client. :meth:`close` ends all three."""

    def __init__(self, prefix: str, objects: ChannelObjects, runtime: Any,
                 side: SideClient) -> None:
        self.prefix, self.side = prefix, side
        self._parts = (side, runtime, objects)

    def tags(self) -> tuple[ControllerTag, ...]:
        """The runtime's own tag list (it is the authority on what it hosts), for the
        engine's ``ModelInfo.controllers``."""
        answer = self.side.request("get_tags", timeout=30).result(timeout=30)
        return tuple(ControllerTag(tag=t.tag, module_id=t.module_id)
                     for t in read(answer, TagList).tags)

    def close(self) -> None:
        close_quietly(*self._parts)


def close_quietly(*parts: Any) -> None:
    """Close each of ``parts`` in order, whatever the others do (an engine's finalizer, often
    at interpreter exit: whatever is left is the OS's to clean up)."""
    for part in parts:
        try:
            part.close()
        except Exception as exc:
            log.debug("closing %s: %s", type(part).__name__, exc)


def attach_runtime(model_dir: str, vocab_size: int, custom: Mapping[str, str],
                   limits: Limits) -> AttachedRuntime:
    """Make the shared-memory objects, start a runtime over them beside this replica
    (:func:`start_runtime`) and open the side channel's client: what every engine kind with
    controllers does before its engine starts."""
    # POSIX names are per host: the pid and a random part keep replicas apart.
    prefix = f"/llmgw-{os.getpid()}-{os.urandom(3).hex()}-"
    objects = ChannelObjects(prefix)
    try:
        runtime = start_runtime(prefix, model_dir, vocab_size, custom, limits)
        side = SideClient(prefix, create=False)
    except BaseException:
        objects.close()
        raise
    return AttachedRuntime(prefix, objects, runtime, side)

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
from engines.controllers.runtime import ControllerFactory, ControllerRuntime, Limits
from engines.controllers.shm import BiasMatrix, MainServer, SideServer

__all__ = ["RuntimeService", "engine_cpus", "load_controllers", "start_runtime"]

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

    def pin_off(self, cpus: list[int]) -> list[int]:
        """Move every thread of this process (new ones inherit it) off ``cpus``; returns the
        CPUs it runs on. Only for a process of its own (the actor): see ``keep_off_engine``."""
        allowed = set(os.sched_getaffinity(0)) - set(cpus)
        if not allowed:  # nothing else to run on: stay
            return sorted(os.sched_getaffinity(0))
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), allowed)
            except OSError:  # a thread that just ended
                pass
        return sorted(allowed)

    def keep_off_engine(self) -> None:
        """In the replica's own process (no Ray) the threads are the replica's: not moved."""

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


def engine_cpus() -> set[int]:
    """The CPUs vLLM's processes under this one are pinned to (its CPU worker binds its compute
    threads to cores of their own; empty when nothing is pinned, as on GPUs)."""
    import psutil

    everything = set(os.sched_getaffinity(0))
    pinned: set[int] = set()
    for child in _descendants(psutil.Process()):
        try:  # every thread: OpenMP runtimes pin each compute thread to a core of its own
            threads = [t.id for t in child.threads()]
        except psutil.Error:
            continue
        for tid in threads:
            try:
                cpus = set(os.sched_getaffinity(tid))
            except OSError:  # gone meanwhile
                continue
            if cpus and cpus < everything:
                pinned |= cpus
    return pinned


def _descendants(root: Any) -> list[Any]:
    """Processes under ``root``, less Ray's: a process that started Ray has its daemons and
    workers under it, and a controller runtime actor among them is pinned (off an engine)."""
    import psutil

    out, todo = [], [root]
    while todo:
        try:
            children = todo.pop().children()
        except psutil.Error:  # gone meanwhile
            continue
        for child in children:
            try:
                name, argv = child.name(), child.cmdline()
            except psutil.Error:
                continue
            if name in _RAY_DAEMONS or (argv and argv[0].startswith("ray::")):
                continue
            out.append(child)
            todo.append(child)
    return out


_RAY_DAEMONS = frozenset({"raylet", "gcs_server"})


class _ActorHandle:
    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def keep_off_engine(self) -> None:
        """Keep the runtime's threads off the engine worker's compute cores (``engine_cpus``,
        called once vLLM is up). The step runs beside the forward pass, so on the worker's
        cores it would take the forward pass's time: at 16 llguidance streams on 2 cores this
        alone cost ~5 % of throughput."""
        import ray

        try:
            cpus = engine_cpus()
            if not cpus:
                return
            where = ray.get(self._actor.pin_off.remote(sorted(cpus)), timeout=30)
            log.info("controller runtime keeps off the engine's CPUs %s: runs on %s",
                     sorted(cpus), where)
        except Exception as exc:  # placement is an optimisation, never a reason to fail
            log.warning("controller runtime: could not move off the engine's CPUs: %s", exc)

    def close(self) -> None:
        import ray

        try:
            ray.get(self._actor.close.remote(), timeout=10)
        except Exception as exc:  # gone already: the shm objects are the owner's to remove
            log.debug("controller runtime actor: %s", exc)
        ray.kill(self._actor)

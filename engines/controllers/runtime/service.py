"""A controller runtime serving one engine's channels: in a process of its own beside the engine
replica (engines/controllers/runtime/process.py), or on threads of the calling process (no Ray: tests,
a bare engine).

The replica creates the shm objects (``ChannelObjects``) and starts this before vLLM: the
engine hook asks ``tokens`` while vLLM builds its logits processors. The replica hands what the
runtime counts (step times, calls cut at their bound) to Ray's metrics
(docs/observability.md): the runtime's own process has no Ray.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from contract import ControllerTag
from engines.controllers.ipc.channels import MainServer, SideClient, SideServer
from engines.controllers.ipc.messages import RuntimeStats, TagList, read
from engines.controllers.ipc.shm import BiasMatrix, ChannelObjects
from engines.controllers.runtime.builtin import BUILTIN_CONTROLLERS, HFTokenizerInfo
from engines.controllers.runtime.process import RuntimeProcess, RuntimeStart
from engines.controllers.runtime.runtime import ControllerFactory, ControllerRuntime, Limits
from engines.kit.telemetry import LEVELS, STEP_BUCKETS_S, Levels, Tally, engine_metrics

__all__ = ["AttachedRuntime", "RuntimeService", "attach_runtime", "close_quietly",
           "load_controllers", "start_runtime"]

log = logging.getLogger(__name__)


def load_controllers(custom: Mapping[str, str]) -> dict[str, ControllerFactory]:
    """The built-ins plus the operator's ``{tag: "package.module:Class"}`` (trusted code; the
    shape is checked where the config is, ``engines.kit.config.Controllers``)."""
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

    def close(self) -> None:
        self._main.close()
        self._side.close()
        for thread in self._threads:
            thread.join(5)
        self.runtime.close()
        self._bias.close()


def start_runtime(model: str, prefix: str, model_dir: str, vocab_size: int,
                  custom: Mapping[str, str], limits: Limits) -> Any:
    """A :class:`RuntimeService` in a process of its own where Ray runs (a replica: its
    controllers' Python then takes neither the replica's GIL nor its CPU time), else on this
    process's threads. Returns an object with ``close()``."""
    import ray

    if not ray.is_initialized():
        return RuntimeService(prefix, model_dir, vocab_size, custom, limits)
    return RuntimeProcess(model, RuntimeStart(prefix, model_dir, vocab_size, dict(custom),
                                              limits))


class AttachedRuntime:
    """An engine replica's controller runtime, as the replica holds it: the shared-memory
    objects it made (``prefix`` names them for the processes that open their ends), the runtime
    serving them, and the side channel's client. :meth:`close` ends all three.

    Once a second, with this process's metric levels, it asks the runtime what it counted and
    hands the news to Ray's metrics: only while controllers ran since it last asked, so an
    idle runtime is never woken for it."""

    def __init__(self, model: str, prefix: str, objects: ChannelObjects, runtime: Any,
                 side: SideClient, levels: Levels = LEVELS) -> None:
        self.prefix, self.side = prefix, side
        self._parts = (side, runtime, objects)
        self._tags = {"model": model}
        self._seen = RuntimeStats(Tally.empty(STEP_BUCKETS_S), {}, 0)
        self._asked_at = 0  # side.sent after the last ask
        self._levels = levels
        levels.export_with_levels(self.export_stats)

    def tags(self) -> tuple[ControllerTag, ...]:
        """The runtime's own tag list (it is the authority on what it hosts), for the
        engine's ``ModelInfo.controllers``."""
        answer = self.side.request("get_tags", timeout=30).result(timeout=30)
        return tuple(ControllerTag(tag=t.tag, module_id=t.module_id)
                     for t in read(answer, TagList).tags)

    def export_stats(self) -> None:
        """What the runtime counted since the last ask, into this process's series."""
        before = self.side.sent
        if before == self._asked_at and not self._seen.live:
            return
        try:
            stats = read(self.side.call("get_stats", timeout=1.0), RuntimeStats)
        except Exception as exc:  # gone or slow: counted at the next ask that works
            log.debug("controller runtime's stats: %s", exc)
            return
        self._asked_at = before + 1  # this ask; a request sent meanwhile means: ask again
        metrics, seen = engine_metrics(), self._seen
        metrics.controller_step.add(stats.step.since(seen.step), self._tags)
        for kind, count in stats.timeouts.items():
            if (new := count - seen.timeouts.get(kind, 0)) > 0:
                metrics.controller_timeouts.inc(new, tags={**self._tags, "kind": kind})
        self._seen = stats

    def close(self) -> None:
        self._levels.stop_exporting(self.export_stats)
        close_quietly(*self._parts)


def close_quietly(*parts: Any) -> None:
    """Close each of ``parts`` in order, whatever the others do (an engine's finalizer, often
    at interpreter exit: whatever is left is the OS's to clean up)."""
    for part in parts:
        try:
            part.close()
        except Exception as exc:
            log.debug("closing %s: %s", type(part).__name__, exc)


def attach_runtime(model: str, model_dir: str, vocab_size: int, custom: Mapping[str, str],
                   limits: Limits) -> AttachedRuntime:
    """Make the shared-memory objects, start a runtime over them beside this replica
    (:func:`start_runtime`) and open the side channel's client: what every engine kind with
    controllers does before its engine starts."""
    # POSIX names are per host: the pid and a random part keep replicas apart.
    prefix = f"/llmgw-{os.getpid()}-{os.urandom(3).hex()}-"
    objects = ChannelObjects(prefix)
    try:
        runtime = start_runtime(model, prefix, model_dir, vocab_size, custom, limits)
    except BaseException:
        objects.close()
        raise
    try:
        side = SideClient(prefix, create=False)
    except BaseException:
        close_quietly(runtime, objects)
        raise
    return AttachedRuntime(model, prefix, objects, runtime, side)

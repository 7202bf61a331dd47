"""The stage actors of one pipe, as the origin drives them: :class:`RayStages` (one Ray actor per
layer range) and :class:`LocalStages` (in-process, for tests and a box without Ray).

Activations go stage → stage by chaining Ray ObjectRefs: the origin submits every stage's call
for a micro-batch at once and awaits only the last one, so nothing returns through the origin
between stages, and several micro-batches in flight keep every stage busy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from engines.pipeline.stage import Hop, StageCore

__all__ = ["LocalStages", "RayStages", "Resolved", "Stages"]

log = logging.getLogger(__name__)

_RESPAWN_S = 600.0  # a respawned stage loads its weights; longer means it cannot be placed


class Stages(Protocol):
    """The stage actors of one pipe, as the origin drives them."""

    depth: int  # micro-batches worth keeping in flight (every stage busy)
    host_hops: bool  # hops must be in host memory (another process carries them)

    def submit(self, hop: Hop, check: bool) -> Awaitable[Hop]:
        """Run ``hop`` through every stage in order; await the result of the last."""
        ...

    def free(self, seq_id: str) -> None: ...

    async def recover(self, patience: float = 60.0) -> None:
        """Respawn dead or unresponsive (``patience`` s) stages, same range and placement, and
        wait until they are ready; TimeoutError when a respawn does not come up."""
        ...

    async def check(self, busy: bool = False) -> None: ...


class Resolved:
    """An awaitable that is already done (a hop, or the error computing it raised); unlike an
    asyncio future it can be made on any thread."""

    def __init__(self, hop: Hop | None = None, error: BaseException | None = None):
        self.hop, self.error = hop, error

    def __await__(self):
        if self.error is not None:
            raise self.error
        return self.hop
        yield  # a generator: `await` drives it


class LocalStages:
    """Stages as in-process :class:`StageCore` s (tests, a box without Ray)."""

    depth = 1  # a submission runs every stage before it returns: nothing to overlap
    host_hops = False  # same process: a hop on the device stays there

    def __init__(self, cores: list[StageCore]):
        self.cores = cores

    def submit(self, hop: Hop, check: bool) -> Awaitable[Hop]:
        try:
            for core in self.cores:
                hop = core.forward(hop, check)
        except Exception as exc:
            return Resolved(error=exc)
        return Resolved(hop)

    def free(self, seq_id: str) -> None:
        for core in self.cores:
            core.free(seq_id)

    async def recover(self, patience: float = 60.0) -> None:
        return None

    async def check(self, busy: bool = False) -> None:
        return None


class RayStages:
    """One Ray actor per layer range, placed by a placement group or custom resources."""

    def __init__(self, model_dir: str, ranges: list[tuple[int, int]], args: Any,
                 label: str = "pipeline"):
        import ray

        from engines.pipeline.stage import stage_actor_class

        self.model_dir, self.ranges, self.args = model_dir, ranges, args
        # One micro-batch per stage: the origin's work on one (sampling, the next embedding)
        # overlaps the stages' on the others. One more was slower on a 2-core box, where the
        # origin and the stages share the cores (docs/benchmarks.md, "Pipeline batching").
        self.depth = len(ranges)
        self.host_hops = True
        self.label = label
        self._spawned = 0
        self._cls = stage_actor_class()
        self._group = None
        if args.placement_strategy is not None:
            from ray.util.placement_group import placement_group

            bundle = {"CPU": args.stage_num_cpus}
            if args.stage_num_gpus:
                bundle["GPU"] = args.stage_num_gpus
            self._group = placement_group([dict(bundle) for _ in ranges],
                                          strategy=args.placement_strategy)
            ray.get(self._group.ready(), timeout=300)
        self.actors = [self._spawn(i) for i in range(len(ranges))]
        ray.get([a.where.remote() for a in self.actors])  # weights loaded, or fail now
        # One recovery at a time: concurrent sequences that saw the same death respawn once.
        self._recovering = asyncio.Lock()

    def _spawn(self, i: int):
        options: dict[str, Any] = {"num_cpus": self.args.stage_num_cpus,
                                   "num_gpus": self.args.stage_num_gpus}
        if self._group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=i)
        elif self.args.stage_resources is not None:
            options["resources"] = self.args.stage_resources[i]
        start, end = self.ranges[i]
        # Named (unique per spawn) so operators and tests can find a stage in `ray list actors`.
        self._spawned += 1
        options["name"] = f"{self.label}:stage{i}:{start}-{end}:{id(self):x}.{self._spawned}"
        return self._cls.options(**options).remote(
            self.model_dir, start, end, self.args.dtype, self.args.attn_implementation,
            self.args.stage_threads, self.args.cache_ttl_s, self.args.device,
            metric_tags={"model": self.label, "stage": f"{i}:{start}-{end}"},
            cpu_kernels=self.args.cpu_kernels)

    def submit(self, hop: Hop, check: bool) -> Awaitable[Hop]:
        ref: Any = hop
        for actor in self.actors:
            ref = actor.forward.remote(ref, check)
        return ref

    def free(self, seq_id: str) -> None:
        for actor in self.actors:
            actor.free.remote(seq_id)  # fire and forget; a dead stage has nothing to free

    async def recover(self, patience: float = 60.0) -> None:
        async with self._recovering:
            from ray.exceptions import RayActorError

            for i, actor in enumerate(self.actors):
                try:
                    await asyncio.wait_for(actor.where.remote(), patience)
                    continue
                except (RayActorError, TimeoutError):
                    pass
                log.warning("stage %d %s is gone or hung; respawning it", i, self.ranges[i])
                import ray

                ray.kill(actor, no_restart=True)
                self.actors[i] = self._spawn(i)
                await asyncio.wait_for(self.actors[i].where.remote(), _RESPAWN_S)

    async def check(self, busy: bool = False) -> None:
        """Every stage answers, or is respawned. A stage answers in order, after the steps
        queued before (one call at a time), so while sequences are in flight (``busy``) a slow
        answer is not a failure: a hung stage is caught by the step timeout instead."""
        from ray.exceptions import RayActorError

        try:
            await asyncio.gather(*(asyncio.wait_for(a.where.remote(), 30) for a in self.actors))
        except RayActorError:
            await self.recover()
        except TimeoutError:
            if not busy:
                raise
        for actor in self.actors:  # the health check's period drives the orphan sweep
            actor.sweep.remote()

    async def where(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(a.where.remote() for a in self.actors)))

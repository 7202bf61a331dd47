"""The stage actors of one pipe, as the origin drives them: :class:`RayStages` (one Ray actor per
layer range) and :class:`LocalStages` (in-process, for tests and a box without Ray).

Between Ray actors, activations go stage → stage over the stage channel (``engines.pipeline.wire``):
the origin sends a micro-batch to the first stage, each stage sends its output straight to the
next, the last one back to the origin; several micro-batches in flight keep every stage busy.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable
from concurrent.futures import Future
from typing import Any, Protocol

from engines.pipeline.stage import Hop, StageCore
from engines.pipeline.wire import StageLost

__all__ = ["LocalStages", "RayStages", "Resolved", "Stages"]

log = logging.getLogger(__name__)

_RESPAWN_S = 600.0  # a respawned stage loads its weights; longer means it cannot be placed
_ANSWER_S = 30.0  # a health check's wait for each stage's answer


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


class _Reply:
    """Awaits a micro-batch's future from the stage channel; whatever ends the wait (its
    result, a timeout, a cancellation), nobody waits for that step any more."""

    def __init__(self, wire: Any, step: int, future: Future):
        self.wire, self.step, self.future = wire, step, future

    def __await__(self):
        try:
            return (yield from asyncio.wrap_future(self.future).__await__())
        finally:
            self.wire.forget(self.step)


class RayStages:
    """One Ray actor per layer range, placed by a placement group or custom resources, chained
    by the stage channel (``engines.pipeline.wire``): Ray places, checks and respawns them,
    the hops go socket to socket."""

    def __init__(self, model_dir: str, ranges: list[tuple[int, int]], args: Any,
                 label: str = "pipeline"):
        import ray

        from engines.pipeline.stage import stage_actor_class
        from engines.pipeline.wire import OriginWire

        self.model_dir, self.ranges, self.args = model_dir, ranges, args
        # One micro-batch per stage: the origin's work on one (sampling, the next embedding)
        # overlaps the stages' on the others. One more was slower on a 2-core box, where the
        # origin and the stages share the cores (docs/results/benchmarks-2026-12-07.md, "Pipeline batching").
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
        self._secret = secrets.token_hex(16)
        self.wire = OriginWire(self._secret, ray.util.get_node_ip_address())
        self._generations = [0] * len(ranges)
        self._vigils: list[Any] = [None] * len(ranges)  # (ObjectRef, its future) per stage
        self._deaths = 0  # stage deaths seen (a recovery mends the pipe only if none came meanwhile)
        self.actors = [self._spawn(i) for i in range(len(ranges))]
        # Weights loaded, or fail now; then each stage sends to the next, the last to the origin.
        self.addresses = [w["address"] for w in ray.get([a.where.remote() for a in self.actors])]
        ray.get([self._link(i) for i in range(len(ranges))])
        self.wire.connect(self.addresses[0])
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
        actor = self._cls.options(**options).remote(
            self.model_dir, start, end, self.args.dtype, self.args.attn_implementation,
            self.args.stage_threads, self.args.cache_ttl_s, self.args.device,
            metric_tags={"model": self.label, "stage": f"{i}:{start}-{end}"},
            cpu_kernels=self.args.cpu_kernels, secret=self._secret)
        self._generations[i] += 1
        self._watch(i, actor)
        return actor

    def _watch(self, i: int, actor: Any) -> None:
        """Fail what is in flight the moment stage ``i``'s process is gone (its vigil call
        errs), rather than after the step timeout: nothing else would tell, its hops go by
        socket. A stage replaced on purpose (its generation moved on) is no loss."""
        generation = self._generations[i]

        def gone(_future) -> None:
            if self._generations[i] == generation:
                self._deaths += 1
                self.wire.fail_all(StageLost(f"stage {i} {self.ranges[i]} is gone"))

        ref = actor.vigil.remote()
        self._vigils[i] = (ref, ref.future())
        self._vigils[i][1].add_done_callback(gone)

    def _link(self, i: int):
        """Stage ``i`` sends to the next stage, or (the last) to the origin."""
        after = self.addresses[i + 1] if i + 1 < len(self.actors) else self.wire.address
        return self.actors[i].connect.remote(after)

    def submit(self, hop: Hop, check: bool) -> Awaitable[Hop]:
        return _Reply(self.wire, hop.step, self.wire.submit(hop, check))  # fails if broken

    def free(self, seq_id: str) -> None:
        self.wire.free(seq_id)  # behind the sequence's hops, through every stage in turn

    async def recover(self, patience: float = 60.0) -> None:
        """Respawn what is dead or hung, wire in what moved, and mend the pipe, again until no
        stage died meanwhile."""
        async with self._recovering:
            while True:
                deaths = self._deaths
                for i in range(len(self.actors)):
                    await self._recover_one(i, patience)
                if self._deaths == deaths:
                    self.wire.mend()
                    return

    async def _recover_one(self, i: int, patience: float) -> None:
        where = await self._where(i, patience)
        # A hop running past half the origin's patience is hung (one micro-batch takes well
        # under a second); the origin gave up on it a little after the stage started it.
        if where is None or where["stuck_s"] > patience / 2:
            log.warning("stage %d %s is gone or hung; respawning it", i, self.ranges[i])
            await self._respawn(i)
            return
        if where["address"] != self.addresses[i]:  # a respawn whose wiring did not finish
            await self._rewire(i, where["address"])
        if self._vigils[i][1].done():  # it answers: its vigil ended for a passing reason
            self._watch(i, self.actors[i])

    async def _where(self, i: int, patience: float) -> dict[str, Any] | None:
        from ray.exceptions import RayActorError

        try:
            return await asyncio.wait_for(self.actors[i].where.remote(), patience)
        except (RayActorError, TimeoutError):
            return None

    async def _respawn(self, i: int) -> None:
        import ray

        self._generations[i] += 1  # its vigil's end is ours, not a loss
        # What is queued in it, or about to be sent, is lost with it: fail it now.
        self.wire.fail_all(StageLost(f"stage {i} {self.ranges[i]} is being respawned"))
        ray.kill(self.actors[i], no_restart=True)
        self.actors[i] = self._spawn(i)
        where = await asyncio.wait_for(self.actors[i].where.remote(), _RESPAWN_S)
        await self._rewire(i, where["address"])

    async def _rewire(self, i: int, address: str) -> None:
        """Stage ``i`` is at ``address`` now: it sends to its successor, its predecessor (or
        the origin) to it."""
        self.addresses[i] = address
        await self._link(i)
        if i == 0:
            self.wire.connect(address)
        else:
            await self._link(i - 1)

    async def check(self, busy: bool = False) -> None:
        """Every stage answers, or is respawned; a hop that has run longer than the step
        timeout is a hung stage (its Ray methods answer while it computes)."""
        from ray.exceptions import RayActorError

        try:
            wheres = await asyncio.gather(*(asyncio.wait_for(a.where.remote(), _ANSWER_S)
                                            for a in self.actors))
        except RayActorError:
            await self.recover(self.args.step_timeout_s)
        except TimeoutError:  # busy: its threads may be slow to answer; the step timeout rules
            if not busy:
                raise
        else:
            if (self.wire.broken() is not None
                    or any(w["stuck_s"] > self.args.step_timeout_s for w in wheres)
                    or any(w["address"] != a for w, a in zip(wheres, self.addresses,
                                                             strict=True))):
                await self.recover(self.args.step_timeout_s)
        for actor in self.actors:  # the health check's period drives the orphan sweep
            actor.sweep.remote()

    async def where(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(a.where.remote() for a in self.actors)))

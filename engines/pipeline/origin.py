"""The origin's side of a pipe: embedding, its own first layers, the chain of stage calls, the
final norm and head, and the restart path when a stage dies or a cache stops lining up.

Activations go stage → stage by chaining Ray ObjectRefs: the origin submits every stage's call
at once and awaits only the last one, so nothing returns through the origin between stages,
and one sequence's prefill chunks (or other sequences' steps) keep every stage busy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from engines.pipeline.loading import OriginParts
from engines.pipeline.stage import CacheMismatch, Hop, StageCore, digest

__all__ = ["LocalStages", "Origin", "PipelineFailure", "RayStages", "Resolved", "Sequence",
           "StageTimeout", "Stages"]

log = logging.getLogger(__name__)

_RESPAWN_S = 600.0  # a respawned stage loads its weights; longer means it cannot be placed


class StageTimeout(RuntimeError):
    """A step did not come back from the stages in time (a hung stage): restart path."""


class PipelineFailure(RuntimeError):
    """A sequence lost its stages more often than ``max_restarts`` allows."""


class Stages(Protocol):
    """The stage actors of one pipe, as the origin drives them."""

    failures: tuple[type[BaseException], ...]  # what the restart path handles
    cancelled: tuple[type[BaseException], ...]  # how the transport reports our own cancellation

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

    failures: tuple[type[BaseException], ...] = (CacheMismatch,)
    cancelled: tuple[type[BaseException], ...] = ()

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
        from ray.exceptions import ObjectLostError, RayActorError, TaskCancelledError

        from engines.pipeline.stage import stage_actor_class

        self.failures = (CacheMismatch, RayActorError, ObjectLostError)
        self.cancelled = (TaskCancelledError,)
        self.model_dir, self.ranges, self.args = model_dir, ranges, args
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
            self.args.stage_threads, self.args.cache_ttl_s, self.args.device)

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


@dataclass
class Sequence:
    """One sequence as the origin tracks it: every token (prompt and output) and how many of
    them the pipe's caches hold."""

    seq_id: str
    tokens: list[int]
    cached: int = 0
    restarts: int = 0


class Origin:
    """Runs sequences through the origin's parts and the stages, and restarts them from their
    tokens when the stages fail. Torch work runs on one thread, off the event loop."""

    def __init__(self, parts: OriginParts, origin_layers: int, stages: Stages, *,
                 prefill_chunk: int, max_restarts: int, check_digest: bool, device: str = "cpu",
                 threads: int | None = None, step_timeout_s: float = 60.0):
        self.parts = parts
        self.own = (StageCore(parts.layers, 0, origin_layers, device=device)
                    if parts.layers is not None else None)
        self.step_timeout_s = step_timeout_s
        self.stages = stages
        self.prefill_chunk = prefill_chunk
        self.max_restarts = max_restarts
        self.check = check_digest
        self.device = device
        self.restarts = 0  # over the origin's life (metrics, tests)
        self.in_flight = 0  # stage chunks submitted and not yet collected, all sequences
        self._threads = threads
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pipeline-origin",
                                        initializer=self._init_thread)

    def _init_thread(self) -> None:
        if self._threads:
            import torch

            torch.set_num_threads(self._threads)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, seq: Sequence) -> list[Awaitable[Hop]]:
        """Start ``seq``'s tokens that the caches don't hold yet through the pipe, in prefill
        chunks (pipelined: nothing waits between them). Runs on the origin's thread, not the
        request's task: Ray Serve cancels a cancelled request's child tasks, and a cancelled,
        never-run stage call would leave that actor's in-order queue waiting for it."""
        start, tokens, pending = seq.cached, seq.tokens, []
        while start < len(tokens):
            end = min(start + self.prefill_chunk, len(tokens))
            try:  # the origin's own layers guard positions too: a mismatch is a restart
                hop = self._embed(seq.seq_id, tokens[start:end], start)
            except CacheMismatch as exc:
                return [Resolved(error=exc)]
            pending.append(self.stages.submit(hop, self.check))
            start = end
        return pending

    async def hidden(self, seq: Sequence, every: bool = False,
                     pending: list[Awaitable[Hop]] | None = None) -> list[Any]:
        """Final hidden states of ``seq``'s tokens the caches don't hold yet (``pending``: the
        calls :meth:`submit` already started for them): the last position only, or
        (``every``) every chunk's. On a stage failure, restarts from position 0."""
        while True:
            try:
                if pending is None:
                    pending = await self.run(self.submit, seq)
                out = await self._collect(pending, every)
                seq.cached = len(seq.tokens)
                return out
            except self.stages.cancelled as exc:  # still our own cancellation
                raise asyncio.CancelledError() from exc
            except (*self.stages.failures, StageTimeout) as exc:
                seq.restarts += 1
                self.restarts += 1
                await self.release(seq.seq_id)
                if seq.restarts > self.max_restarts:
                    raise PipelineFailure(f"the pipeline failed {seq.restarts} times on this "
                                          f"request (last: {type(exc).__name__})") from exc
                log.warning("restarting %s from its %d tokens after %r", seq.seq_id,
                            len(seq.tokens), exc)
                try:
                    await self.stages.recover(self._patience())
                except TimeoutError as timeout:
                    raise PipelineFailure("a respawned stage did not come up") from timeout
                seq.cached, pending = 0, None

    def _patience(self) -> float:
        """How long a stage may take to answer: a step queues behind every chunk in flight
        (all sequences'), so the allowance grows with them."""
        return self.step_timeout_s * max(1, self.in_flight)

    async def _collect(self, pending: list[Awaitable[Hop]], every: bool) -> list[Any]:
        self.in_flight += len(pending)
        try:
            async with asyncio.timeout(self._patience()):
                hops = await asyncio.gather(*pending) if every else [await pending[-1]]
        except TimeoutError:
            raise StageTimeout(f"no answer from the stages in {self._patience():.0f} s") from None
        finally:
            self.in_flight -= len(pending)
        for hop in hops:
            if self.check and hop.digest != digest(hop.hidden, hop.positions, hop.seq_id,
                                                   hop.step):
                raise CacheMismatch(f"digest mismatch on the way back for {hop.seq_id}")
        return [hop.hidden for hop in hops] if every else [hops[-1].hidden[:, -1:]]

    def _embed(self, seq_id: str, ids: list[int], start: int) -> Hop:
        import torch

        with torch.inference_mode():
            positions = torch.arange(start, start + len(ids))
            hidden = self.parts.embed(torch.tensor([ids], device=self.device))
            hop = Hop(hidden=hidden.cpu(), positions=positions, seq_id=seq_id, step=start)
            if self.own is not None:
                hop = self.own.forward(hop)
            if self.check:
                hop.digest = digest(hop.hidden, hop.positions, seq_id, start)
            return hop

    def logits(self, hidden) -> Any:
        """``[T, vocab]`` float32 logits of final hidden states ``[1, T, H]``."""
        import torch

        with torch.inference_mode():
            return self.parts.logits(hidden.to(self.device))[0].cpu()

    async def release(self, seq_id: str) -> None:
        """Free ``seq_id`` everywhere, on the origin's thread: after any submission for it that
        is still running there (which would otherwise re-create a cache after the free), and
        shielded, so a second cancellation cannot skip it."""
        await asyncio.shield(self.run(self._release, seq_id))

    def _release(self, seq_id: str) -> None:
        if self.own is not None:
            self.own.free(seq_id)
        self.stages.free(seq_id)

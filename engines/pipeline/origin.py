"""The origin's side of a pipe: a scheduler that batches every running sequence's next tokens into
micro-batches, the embedding and its own first layers, the final norm and head over a whole
micro-batch, and the restart path when a stage dies or a cache stops lining up
(docs/protocols/pipeline.md, "Batching").

Each :class:`Job` is one sequence. The launcher packs waiting jobs' decode tokens and prefill
chunks into micro-batches and keeps up to ``depth`` in flight; the collector takes them back in
order, computes the logits of every finished sequence in one matmul and calls each job's
``step`` (sampling) on the origin thread; a job that goes on waits again with its micro-batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engines.kit.telemetry import engine_metrics
from engines.pipeline.jobs import Job, PipelineFailure, StageTimeout, lost_on_the_way
from engines.pipeline.loading import OriginParts
from engines.pipeline.stage import CacheMismatch, Hop, StageCore, digest
from engines.pipeline.stages import Resolved, Stages

__all__ = ["Origin"]

log = logging.getLogger(__name__)

# Results a job may hold undelivered: a slow reader stops its own sequence there, not the batch.
OUTBOX = 8
# Fewer running sequences are not split across micro-batches in flight: a small batch costs
# about what one sequence does, so halving it halves the work per step (4 sequences on 2 stages:
# 38.9 tok/s as one micro-batch, 32.4 as two; docs/results/benchmarks-2026-12-07.md, "Pipeline batching").
_MIN_SHARE = 8


@dataclass
class _Member:
    job: Job
    epoch: int
    start: int
    end: int


@dataclass
class _Batch:
    result: Any  # awaitable Hop
    members: list[_Member]
    sent_s: float  # time.perf_counter() when its hop left for the stages


class Origin:
    """Runs jobs through the origin's parts and the stages, in micro-batches, and restarts a
    job's sequence from its tokens when the stages fail. Torch work runs on one thread."""

    def __init__(self, parts: OriginParts, origin_layers: int, stages: Stages, *,
                 prefill_chunk: int, max_restarts: int, check_digest: bool, device: str = "cpu",
                 threads: int | None = None, step_timeout_s: float = 60.0,
                 max_batch_tokens: int = 256, batches_in_flight: int | None = None,
                 before_steps: Callable[[list[tuple[Any, list[int]]]], None] | None = None,
                 model: str = ""):
        self.parts = parts
        self._tags = {"model": model}  # of its series (engines.kit.telemetry)
        # Called on the origin thread with (control, tokens) of the micro-batch's controlled
        # sequences about to sample, before any of them does (the engine's controller hook).
        self.before_steps = before_steps
        self.own = (StageCore(parts.layers, 0, origin_layers, device=device, host_hops=False)
                    if parts.layers is not None else None)
        self.step_timeout_s = step_timeout_s
        self.stages = stages
        self.prefill_chunk = prefill_chunk
        self.max_batch_tokens = max(max_batch_tokens, 1)
        self.depth = batches_in_flight or stages.depth
        self.max_restarts = max_restarts
        self.check = check_digest
        self.device = device
        self.restarts = 0  # over the origin's life (metrics, tests)
        self.batches = 0  # micro-batches sent (tests, metrics)
        self._threads = threads
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pipeline-origin",
                                        initializer=self._init_thread)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _init_thread(self) -> None:
        if self._threads:
            import torch

            torch.set_num_threads(self._threads)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # --- jobs ---------------------------------------------------------------------------

    async def generate(self, job: Job) -> AsyncIterator[Any]:
        """Run ``job`` until its step says done: each step's payload, in order. Raises
        :class:`PipelineFailure` when its sequence cannot be run. Closing it early (a client
        gone, a deadline) frees the sequence's caches everywhere."""
        self._ensure_running()
        self._jobs.add(job)
        self._enqueue(job)
        try:
            while True:
                while not job.outbox:
                    job.ready.clear()
                    await job.ready.wait()
                item = job.outbox.popleft()
                if isinstance(item, BaseException):
                    raise item
                if job.parked:
                    job.parked = False
                    self._enqueue(job)
                payload, done = item
                yield payload
                if done:
                    return
        finally:
            job.closed = True
            self._jobs.discard(job)
            with contextlib.suppress(ValueError):
                self._waiting.remove(job)
            await self.release(job.seq.seq_id)

    def _enqueue(self, job: Job) -> None:
        if not job.closed and job not in self._waiting:
            self._waiting.append(job)
            self._wake.set()

    def _deliver(self, job: Job, item: Any) -> None:
        job.outbox.append(item)
        job.ready.set()

    # --- the scheduler --------------------------------------------------------------------

    def _ensure_running(self) -> None:
        """The launcher and the collector, started in this loop (again after a new loop, as in
        tests). In a fresh context: they outlive the request that happened to start them."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and not any(task.done() for task in self._tasks):
            return
        if self._loop is not None:  # no task of an old run may touch the new run's state
            self._stop_tasks()
        self._loop = loop
        self._jobs: set[Job] = set()
        self._waiting: deque[Job] = deque()
        self._in_flight: deque[_Batch] = deque()
        self._finishing = 0  # micro-batches back from the stages, being sampled
        self._wake, self._landed = asyncio.Event(), asyncio.Event()
        context = contextvars.Context()
        self._tasks = [loop.create_task(self._guarded(self._launch), context=context),
                       loop.create_task(self._guarded(self._collect), context=context)]

    def _stop_tasks(self) -> None:
        for task in self._tasks:
            if task is not asyncio.current_task():
                with contextlib.suppress(RuntimeError):  # a task of a loop that is closed
                    task.cancel()

    async def _guarded(self, loop_fn: Callable[[], Any]) -> None:
        try:
            await loop_fn()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug here would hang every job: fail them instead
            log.exception("the pipeline scheduler stopped")
            self._stop_tasks()  # the next job starts a fresh run
            for job in list(self._jobs):
                self._deliver(job, PipelineFailure(f"the pipeline scheduler stopped: {exc!r}"))

    async def _launch(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting and len(self._in_flight) < self.depth:
                members = self._take(decoding=len(self._jobs) >= _MIN_SHARE or
                                     not (self._in_flight or self._finishing))
                if not members:
                    break
                self.batches += 1
                try:
                    result, dropped = await self.run(self._send, members, self.batches)
                except Exception as exc:  # the embedding or the origin's layers, this batch's
                    log.exception("sending micro-batch %d failed", self.batches)
                    await self._restart([m.job for m in members if self._current(m)], exc)
                    continue
                self._in_flight.append(_Batch(result, members, time.perf_counter()))
                engine_metrics().pipeline_batch_tokens.inc(
                    sum(m.end - m.start for m in members), tags=self._tags)
                self._landed.set()
                await self._restart_dropped(members, dropped)

    def _take(self, decoding: bool = True) -> list[_Member]:
        """Waiting jobs for the next micro-batch, oldest first: a share of the running jobs
        (so ``depth`` micro-batches keep the pipe full, but no fewer than ``_MIN_SHARE``), each
        its next token or prompt chunk, within the token budget. A job with prompt left stays
        waiting for the next one. Not ``decoding``: prompt chunks only (fewer than
        ``_MIN_SHARE`` running, a decode step waits for the micro-batch in flight, so that
        sequences that started apart still decode as one micro-batch; a prompt's chunks
        still fill the pipe)."""
        running = len(self._jobs)
        share = running if running < _MIN_SHARE else -(-running // self.depth)
        budget, members = self.max_batch_tokens, []
        for job in list(self._waiting):
            if len(members) == share or budget == 0:
                break
            seq = job.seq
            if not decoding and len(seq.tokens) - seq.sent <= 1:
                continue
            end = min(len(seq.tokens), seq.sent + min(self.prefill_chunk, budget))
            members.append(_Member(job, job.epoch, seq.sent, end))
            budget -= end - seq.sent
            seq.sent = end
            if end == len(seq.tokens):
                self._waiting.remove(job)
        return members

    def _send(self, members: list[_Member], step: int) -> tuple[Any, dict[str, str]]:
        """On the origin thread (not a request's task: Ray Serve cancels a cancelled request's
        child tasks, and a never-run stage call would leave an actor's in-order queue waiting
        for it): embed, the origin's own layers, then every stage's call."""
        import torch

        ids = [t for m in members for t in m.job.seq.tokens[m.start:m.end]]
        positions = torch.cat([torch.arange(m.start, m.end) for m in members])
        with torch.inference_mode():
            hidden = self.parts.embed(torch.tensor([ids], device=self.device))
        hop = Hop(hidden, positions, tuple(m.job.seq.seq_id for m in members),
                  tuple(m.end - m.start for m in members), step)
        if self.own is not None:  # its own position guard may drop some
            hop = self.own.forward(hop)
        if self.stages.host_hops:
            hop.hidden = hop.hidden.cpu()
        dropped, hop.dropped = hop.dropped, {}
        if not hop.seq_ids:
            return Resolved(hop), dropped
        return self.stages.submit(hop.sign() if self.check else hop, self.check), dropped

    async def _collect(self) -> None:
        while True:
            while not self._in_flight:
                self._landed.clear()
                await self._landed.wait()
            batch = self._in_flight[0]
            try:
                hop = await self._receive(batch)
            except Exception as exc:  # a lost or hung stage, a digest, an error in a stage
                self._in_flight.popleft()
                self._wake.set()
                await self._restart([m.job for m in batch.members if self._current(m)], exc)
                continue
            self._in_flight.popleft()
            engine_metrics().pipeline_batch.observe(time.perf_counter() - batch.sent_s,
                                                    tags=self._tags)
            self._wake.set()  # the launcher may send others' tokens while these are sampled
            self._finishing += 1  # (decode steps of few sequences wait for these: _take)
            try:
                results = await self.run(self._finish, batch, hop)
            except Exception as exc:  # the head or a split: these jobs fail, others go on
                log.exception("finishing micro-batch %d failed", hop.step)
                failure = PipelineFailure(f"the origin failed: {type(exc).__name__}")
                results = [(m.job, failure) for m in batch.members if self._current(m)]
            finally:
                self._finishing -= 1
                self._wake.set()
            for job, item in results:
                self._deliver(job, item)
                if isinstance(item, tuple) and not item[1]:
                    if len(job.outbox) >= OUTBOX:
                        job.parked = True
                    else:
                        self._enqueue(job)
            await self._restart_dropped(batch.members, lost_on_the_way(
                {m.job.seq.seq_id for m in batch.members}, hop.seq_ids, hop.dropped))

    async def _receive(self, batch: _Batch) -> Hop:
        # It may wait behind every other micro-batch in flight (a stage runs calls in order).
        patience = self.step_timeout_s * len(self._in_flight)
        try:
            async with asyncio.timeout(patience):
                hop = await batch.result
        except TimeoutError:
            raise StageTimeout(f"no answer from the stages in {patience:.0f} s") from None
        if self.check and hop.digest != digest(hop):
            raise CacheMismatch(f"digest mismatch on the way back for micro-batch {hop.step}")
        return hop

    def _current(self, member: _Member) -> bool:
        return not member.job.closed and member.epoch == member.job.epoch

    def _finish(self, batch: _Batch, hop: Hop) -> list[tuple[Job, Any]]:
        """On the origin thread: split the micro-batch's final hidden states by sequence; the
        logits of every sequence whose tokens are all through, in one matmul; their steps."""
        rows = dict(zip(hop.seq_ids, hop.hidden.split(list(hop.lengths), dim=1), strict=True))
        done: list[tuple[Job, Any]] = []
        for m in batch.members:
            hidden = rows.get(m.job.seq.seq_id)
            if hidden is None or not self._current(m):
                continue
            if m.job.every and not m.job.stepped:
                m.job.prompt_hidden.append(hidden)
            if m.end == len(m.job.seq.tokens):
                done.append((m.job, hidden[:, -1:]))
        if not done:
            return []
        import torch

        logits = self.logits(torch.cat([last for _, last in done], dim=1))
        self._before_steps(done)
        return [(job, self._step(job, row)) for (job, _), row in zip(done, logits, strict=True)]

    def _before_steps(self, done: list[tuple[Job, Any]]) -> None:
        """The controlled sequences about to sample, to ``before_steps`` at once (one round
        trip to the controllers for the micro-batch, engines/pipeline/controlled.py)."""
        controlled = [(job.control, job.seq.tokens) for job, _ in done if job.control is not None]
        if not controlled or self.before_steps is None:
            return
        try:
            self.before_steps(controlled)
        except Exception:  # each sequence's own step asks again, alone
            log.exception("asking the controllers for micro-batch failed")

    def _step(self, job: Job, logits: Any) -> Any:
        prompt = job.prompt_hidden if job.every and not job.stepped else None
        job.stepped = True
        try:
            return job.step(logits, prompt)
        except Exception as exc:  # the job's own bug: that job fails, the batch goes on
            log.exception("a pipeline step failed for %s", job.seq.seq_id)
            return PipelineFailure(f"the step failed: {type(exc).__name__}")

    # --- restarts -------------------------------------------------------------------------

    async def _restart_dropped(self, members: list[_Member], dropped: dict[str, str]) -> None:
        if dropped:
            lost = [m.job for m in members if m.job.seq.seq_id in dropped and self._current(m)]
            await self._restart(lost, CacheMismatch(next(iter(dropped.values()))))

    async def _restart(self, jobs: list[Job], exc: BaseException) -> None:
        """Free these sequences everywhere and send them again from position 0 (after the
        stages are recovered), or fail the ones past ``max_restarts``."""
        jobs = [job for job in dict.fromkeys(jobs) if not job.closed]
        for job in jobs:  # all before the first await: one failure is one restart
            job.epoch += 1  # what is still in flight for it is void now
            job.seq.restarts += 1
            self.restarts += 1
            engine_metrics().pipeline_restarts.inc(1, tags=self._tags)
            with contextlib.suppress(ValueError):
                self._waiting.remove(job)
        for job in jobs:
            await self.release(job.seq.seq_id)
        retry = []
        for job in jobs:
            if job.seq.restarts > self.max_restarts:
                self._deliver(job, PipelineFailure(
                    f"the pipeline failed {job.seq.restarts} times on this request "
                    f"(last: {type(exc).__name__})"))
            else:
                log.warning("restarting %s from its %d tokens after %r", job.seq.seq_id,
                            len(job.seq.tokens), exc)
                retry.append(job)
        if retry and not isinstance(exc, CacheMismatch):  # a stage may be dead or hung
            try:
                await self.stages.recover(self.step_timeout_s)
            except Exception as failed:  # a respawn that does not come up, or cannot start
                log.error("recovering the stages failed: %r", failed)
                for job in retry:
                    self._deliver(job, PipelineFailure("a respawned stage did not come up"))
                return
        for job in retry:
            job.seq.sent = 0
            job.prompt_hidden.clear()
            self._enqueue(job)

    # --- the origin's parts ---------------------------------------------------------------

    def logits(self, hidden) -> Any:
        """``[T, vocab]`` float32 logits of final hidden states ``[1, T, H]``."""
        import torch

        with torch.inference_mode():
            return self.parts.logits(hidden.to(self.device))[0].cpu()

    async def release(self, seq_id: str) -> None:
        """Free ``seq_id`` everywhere, on the origin thread: after any submission for it that
        is still running there (which would otherwise re-create a cache after the free), and
        shielded, so a second cancellation cannot skip it."""
        await asyncio.shield(self.run(self._release, seq_id))

    def _release(self, seq_id: str) -> None:
        if self.own is not None:
            self.own.free(seq_id)
        self.stages.free(seq_id)

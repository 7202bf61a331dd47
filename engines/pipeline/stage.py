"""One pipeline stage: a contiguous layer range and the keys and values of every live sequence.

:class:`StageCore` is plain Python + torch (tests, a bare GPU box, the origin's own layers);
:func:`stage_actor_class` wraps it as a Ray actor. A stage sees hidden states and positions
only: no token ids, no text. Every call is idempotent by position (the guard in
:meth:`StageCore.forward`), so a duplicated step is recomputed, and a lost one is detected.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from engines.kit.telemetry import LEVELS, Levels, engine_metrics

__all__ = ["CacheMismatch", "Hop", "StageCore", "digest", "stage_actor_class"]


class CacheMismatch(RuntimeError):
    """A stage's cache does not line up with the positions it was sent: the origin restarts
    the sequence (frees every stage's cache and re-prefills from its tokens)."""


@dataclass
class Hop:
    """A micro-batch crossing from one stage to the next: ``hidden`` ``[1, T, H]``, the tokens of
    every sequence packed end to end (``seq_ids`` and their token counts ``lengths``, in that
    order), and the absolute ``positions`` ``[T]`` of each token in its own sequence. ``step``
    numbers the micro-batch; ``dropped`` names the sequences a stage's position guard took out
    on the way (id → why), each restarted by the origin alone; ``digest`` (optional) covers the
    rest, so a corrupted or misrouted hop is caught on receipt."""

    hidden: Any
    positions: Any
    seq_ids: tuple[str, ...]
    lengths: tuple[int, ...]
    step: int
    digest: bytes | None = None
    dropped: dict[str, str] = field(default_factory=dict)

    @classmethod
    def single(cls, hidden, positions, seq_id: str, step: int = 0) -> Hop:
        """One sequence's tokens as a micro-batch of one."""
        return cls(hidden, positions, (seq_id,), (int(positions.shape[0]),), step)

    def starts(self) -> list[int]:
        """Where each sequence's tokens start in the packed tensor."""
        return [0, *itertools.accumulate(self.lengths)][:-1]

    def firsts(self) -> list[int]:
        """Each sequence's first position in this hop."""
        return [int(self.positions[start]) for start in self.starts()]

    def only(self, keep: list[int]) -> Hop:
        """The same hop with only the sequences at indices ``keep`` (no digest)."""
        import torch

        if len(keep) == len(self.seq_ids):
            return replace(self, digest=None)
        starts = self.starts()
        rows = [torch.arange(starts[i], starts[i] + self.lengths[i]) for i in keep]
        index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        return replace(self, hidden=self.hidden[:, index], positions=self.positions[index],
                       seq_ids=tuple(self.seq_ids[i] for i in keep),
                       lengths=tuple(self.lengths[i] for i in keep), digest=None)

    def sign(self) -> Hop:
        self.digest = digest(self)
        return self


def digest(hop: Hop) -> bytes:
    """blake2b of the activation bytes, positions, sequences and step (transport integrity
    only: a dishonest stage can still return a steered tensor with a valid digest)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(hop.hidden.cpu().contiguous().view(-1).view(dtype=_u8()).numpy().tobytes())
    h.update(hop.positions.contiguous().numpy().tobytes())
    h.update("\0".join(hop.seq_ids).encode())
    h.update(b"".join(n.to_bytes(8, "little") for n in hop.lengths))
    h.update(hop.step.to_bytes(8, "little"))
    return h.digest()


def _u8():
    import torch

    return torch.uint8


class StageCore:
    """Layers ``[start, end)`` of a model (a sliced base model, see ``loading``) and the keys and
    values of every live sequence (one ``KVPool``); a micro-batch runs through them as one
    forward (``packed``)."""

    def __init__(self, model, start: int, end: int, ttl_s: float = 600.0, device: str = "cpu",
                 host_hops: bool = True, metric_tags: dict[str, str] | None = None,
                 levels: Levels = LEVELS):
        """``metric_tags`` (model, stage): this stage's series go to Ray's metrics (a stage
        actor's), its caches' gauges set with ``levels``; without tags nothing is recorded
        (in-process stages, the origin's layers)."""
        from engines.pipeline.kvpool import KVPool
        from engines.pipeline.packed import use_packed_attention

        use_packed_attention(model)
        self.model = model
        self.device = device  # where the layers compute
        # Hops leave in host memory (for Ray to carry), or stay on the device for a consumer
        # in this process on the same device (the origin's own layers, in-process stages).
        self.host_hops = host_hops
        self.start, self.end = start, end
        self.ttl_s = ttl_s
        self.pool = KVPool()
        self.used: dict[str, float] = {}
        self._last_sweep = time.monotonic()
        self._lock = threading.Lock()  # the origin's layers run from a thread pool
        self.metric_tags = metric_tags
        if metric_tags is not None:
            levels.export_with_levels(self._export_cache_levels)

    def forward(self, hop: Hop, check: bool = False) -> Hop:
        """Run the layers over ``hop``; the returned hop carries a fresh digest when ``check``.

        The position guard, per sequence (docs/protocols/pipeline.md): ``first == 0`` or no
        cache → a new cache; ``first`` equal to the cached length → a normal step; below it → a
        duplicate, cropped and recomputed; above it → a lost step: that sequence's cache is
        dropped and it leaves the micro-batch (``dropped``), the others go on.
        """
        if check and hop.digest != digest(hop):
            raise CacheMismatch(f"digest mismatch on micro-batch {hop.step}")
        started = time.perf_counter()
        with self._lock:
            self._maybe_sweep()
            keep, dropped = [], dict(hop.dropped)
            firsts = hop.firsts()
            for i, (seq_id, first) in enumerate(zip(hop.seq_ids, firsts, strict=True)):
                try:
                    self._guard(seq_id, first)
                    keep.append(i)
                except CacheMismatch as exc:
                    self._drop(seq_id)
                    dropped[seq_id] = str(exc)
            batch = hop.only(keep)
            try:
                out = (self._layers(batch, [firsts[i] for i in keep]) if keep
                       else batch.hidden)
            except BaseException:
                # A half-written cache is of no use: the origin restarts these from 0.
                for seq_id in batch.seq_ids:
                    self._drop(seq_id)
                raise
        if self.metric_tags is not None:
            engine_metrics().pipeline_stage.observe(time.perf_counter() - started,
                                                    tags=self.metric_tags)
        result = replace(batch, hidden=out, dropped=dropped)
        return result.sign() if check else result

    def _layers(self, batch: Hop, firsts: list[int]):
        import torch

        from engines.pipeline.packed import PooledBatch, run_layers

        lengths = list(batch.lengths)
        for seq_id, first, length in zip(batch.seq_ids, firsts, lengths, strict=True):
            self.pool.extend(seq_id, first + length)
        packed = PooledBatch.build(self.pool, batch.seq_ids, lengths, firsts, batch.positions,
                                   self.device)
        with torch.inference_mode():
            out = run_layers(self.model, batch.hidden.to(self.device), packed)
            return out.cpu() if self.host_hops else out

    def _guard(self, seq_id: str, first: int) -> None:
        cached = self.pool.length(seq_id)
        if cached is None or first == 0:
            if first != 0:
                raise CacheMismatch(f"{seq_id}: no cache here for position {first}")
            self.pool.start(seq_id)
        elif first > cached:
            raise CacheMismatch(f"{seq_id}: step at {first} but {cached} cached")
        elif first < cached:
            self.pool.crop(seq_id, first)
        self.used[seq_id] = time.monotonic()

    def free(self, seq_id: str) -> None:
        with self._lock:
            self._drop(seq_id)

    def cached(self) -> dict[str, int]:
        """Live sequences and their cached lengths (tests, health)."""
        with self._lock:
            return self.pool.lengths()

    def cache_bytes(self) -> int:
        """Bytes of keys and values held now, every sequence (bounds, benchmarks)."""
        with self._lock:
            return self._cache_bytes()

    def _cache_bytes(self) -> int:
        return self.pool.held_bytes()

    def _export_cache_levels(self) -> None:
        """What the caches hold, for Ray's gauges (once a second, from the levels' thread)."""
        with self._lock:
            lengths = self.pool.lengths()
            held = (self._cache_bytes(), sum(lengths.values()), len(lengths))
        metrics = engine_metrics()
        for gauge, value in zip((metrics.pipeline_stage_kv_bytes,
                                 metrics.pipeline_stage_kv_tokens,
                                 metrics.pipeline_stage_sequences), held, strict=True):
            gauge.set(value, tags=self.metric_tags)

    def sweep(self, ttl_s: float | None = None, wait: bool = True) -> int:
        """Drop caches idle longer than the TTL (orphans of a lost origin); how many went. Not
        ``wait``: none while a forward holds the caches (the next sweep, or the forward's own)."""
        if not self._lock.acquire(blocking=wait):
            return 0
        try:
            return self._sweep(self.ttl_s if ttl_s is None else ttl_s)
        finally:
            self._lock.release()

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep > self.ttl_s / 4:
            self._last_sweep = now
            self._sweep(self.ttl_s)

    def _sweep(self, ttl_s: float) -> int:
        cutoff = time.monotonic() - ttl_s
        stale = [k for k, t in self.used.items() if t < cutoff]
        for k in stale:
            self._drop(k)
        return len(stale)

    def _drop(self, seq_id: str) -> None:
        self.pool.drop(seq_id)
        self.used.pop(seq_id, None)


def _load_stage_layers(model_dir: str, start: int, end: int, dtype: str,
                       attn_implementation: str, threads: int | None, device: str,
                       cpu_kernels: str):
    """Layers ``[start, end)`` of the checkpoint on ``device``, packed for oneDNN where
    ``cpu_kernels`` asks and the device and dtype allow (docs/results/benchmarks-2026-12-07.md, "Packed
    weights")."""
    import torch

    from engines.pipeline.kernels import pack_linears, packs
    from engines.pipeline.loading import load_layers

    if threads:
        torch.set_num_threads(threads)
    model = load_layers(model_dir, start, end, getattr(torch, dtype), attn_implementation)
    if packs(cpu_kernels, device, model.dtype):
        pack_linears(model)
    return model.to(device)


def stage_actor_class():
    """The Ray actor class hosting one :class:`StageCore` (imported lazily: no Ray at import).
    Hops reach it over the stage channel (``engines.pipeline.wire``), not as Ray calls; its Ray
    methods (wiring, health, frees of a whole sweep) run on threads of their own, so they answer
    while a hop computes."""
    import ray

    # Thread pools of their own: the vigil holds one for good, and a hop that hangs holding
    # the caches' lock cannot take the threads `where` and `connect` answer on.
    @ray.remote(max_restarts=0, max_task_retries=0,
                concurrency_groups={"vigil": 1, "wiring": 2, "caches": 2})
    class StageActor:
        """Loads its layers in the constructor, so a respawn with the same arguments is the
        same stage."""

        def __init__(self, model_dir: str, start: int, end: int, dtype: str,
                     attn_implementation: str, threads: int | None, ttl_s: float,
                     device: str = "cpu", metric_tags: dict[str, str] | None = None,
                     cpu_kernels: str = "packed", secret: str = ""):
            from engines.kit import placement
            from engines.pipeline.wire import StageServer

            # Computes: not moved off an engine's cores, and on every CPU again (a worker forked
            # from a raylet that was moved starts on the serving CPUs only).
            placement.claim()
            model = _load_stage_layers(model_dir, start, end, dtype, attn_implementation,
                                       threads, device, cpu_kernels)
            self.core = StageCore(model, start, end, ttl_s, device,
                                  metric_tags=metric_tags)
            self.server = StageServer(self.core, secret, ray.util.get_node_ip_address())
            self._forever = threading.Event()

        @ray.method(concurrency_group="wiring")
        def connect(self, address: str) -> None:
            """Send what this stage computes to ``address`` (the next stage's, or the origin's)."""
            self.server.connect(address)

        @ray.method(concurrency_group="vigil")
        def vigil(self) -> None:
            """Never answers: the caller's reference fails the moment this process is gone."""
            self._forever.wait()

        @ray.method(concurrency_group="caches")
        def cached(self) -> dict[str, int]:
            return self.core.cached()

        @ray.method(concurrency_group="caches")
        def sweep(self, ttl_s: float | None = None) -> int:
            return self.core.sweep(ttl_s, wait=False)

        @ray.method(concurrency_group="wiring")
        def where(self) -> dict[str, Any]:
            """Node, layer range, the channel's address, and how long the hop running now has
            run (placement tests, wiring, health)."""
            return {"node_id": ray.get_runtime_context().get_node_id(),
                    "range": [self.core.start, self.core.end], "address": self.server.address,
                    "stuck_s": self.server.stuck_s()}

    return StageActor

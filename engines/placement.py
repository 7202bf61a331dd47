"""Keep the serving stack off the cores an engine computes on.

vLLM's CPU worker binds its compute threads to cores of its own and leaves the rest ("reserved
CPUs") to everything else, but nothing else is told: Ray's daemons, Serve's controller and
proxy, HAProxy, the replicas and the engine's own scheduler process stay free to run on the
worker's cores. Each of their wake-ups there preempts the forward pass. On a 2-core box with
the embedded model in bf16 that cost the fast layout 12 % of its throughput (250 -> 282 tok/s
with everything moved, alternating on one running gateway; bare vLLM unchanged by the same move;
docs/benchmarks.md).

:func:`place` moves every process of this Ray node, threads included, onto the CPUs no vLLM
worker is pinned to. What computes stays where it is: vLLM's workers, and the processes that
called :func:`claim_compute` (pipeline stage actors, the pipeline's origin replica), which also
run on every CPU again. A Ray worker forked from a raylet that was moved starts on the serving
CPUs only, so a vLLM replica calls :func:`widen` before vLLM picks its worker's cores.

Only inside a Ray worker process (a replica, an actor), never in a driver or a test process;
``LLM_GATEWAY_PLACEMENT=off`` turns it off. Placement never fails a start: an error is logged
and the node runs as it was. A node whose last engine stopped keeps its placement until the
next engine starts and places it again.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["COMPUTE_TITLES", "claim_compute", "place", "serving_cpus", "widen"]

log = logging.getLogger(__name__)

# Process titles of what computes: never moved by :func:`place`.
COMPUTE_TITLES = ("VLLM::Worker",)
# In the Ray session's directory: the pids that claimed to compute, one per line.
_CLAIMS = "llm_gateway_compute_pids"


def enabled() -> bool:
    return os.environ.get("LLM_GATEWAY_PLACEMENT", "on").lower() not in ("off", "0", "false")


def widen() -> set[int]:
    """Let every thread of this process run on every CPU the kernel allows it (the cpuset
    intersects the request); returns that set. Called before vLLM picks its cores (from this
    process's affinity) and before a stage actor imports torch (OpenMP sizes its pool then)."""
    if not (enabled() and _in_ray_worker()):
        return set(os.sched_getaffinity(0))
    everything = set(range(os.cpu_count() or 1))
    _set_threads(os.getpid(), everything)
    return set(os.sched_getaffinity(0))


def claim_compute() -> None:
    """This process computes (a pipeline stage or origin): :func:`place` leaves it alone, and
    it runs on every CPU again. Before torch loads OpenMP where possible, which sizes its pool
    from this process's CPUs."""
    widen()
    if not (enabled() and _in_ray_worker()):
        return
    try:
        session = _session_dir(_raylet())
        if session:
            with open(os.path.join(session, _CLAIMS), "a") as claims:
                claims.write(f"{os.getpid()}\n")
    except Exception as exc:  # placement is an optimisation
        log.warning("could not claim this process as computing: %s", exc)


def serving_cpus(allowed: set[int], engines: set[int]) -> set[int]:
    """Where the serving stack runs: the allowed CPUs no engine computes on, or all of them
    when engines hold every one (nothing else to go to)."""
    return (allowed - engines) or allowed


def place() -> dict[str, Any] | None:
    """Move this node's serving processes off every vLLM worker's cores (see the module's
    doc). Returns what it did, or None where it does not apply."""
    if not enabled():
        return None
    try:
        if not _in_ray_worker():
            return None
        raylet = _raylet()
        if raylet is None:
            return None
        procs = _node_processes(raylet)
        claimed = _claimed(_session_dir(raylet))
        allowed = set(range(os.cpu_count() or 1)) & set(os.sched_getaffinity(0))
        compute = [p for p in procs if p.pid in claimed or _title(p).startswith(COMPUTE_TITLES)]
        engines = _pinned([p for p in compute if _title(p).startswith("VLLM::Worker")], allowed)
        if not engines:
            return None
        target = serving_cpus(allowed, engines)
        moved = sum(_set_threads(p.pid, target) for p in procs if p not in compute)
        log.info("serving processes (%d threads) moved to CPUs %s, off the engines' %s",
                 moved, sorted(target), sorted(engines))
        return {"engine_cpus": sorted(engines), "serving_cpus": sorted(target), "threads": moved}
    except Exception as exc:  # an optimisation, never a reason to fail
        log.warning("could not keep the serving processes off the engine's CPUs: %s", exc)
        return None


def _in_ray_worker() -> bool:
    """In a Ray worker (a replica, an actor): the node's processes are Ray's to place, never a
    driver's or a test process's own."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def _title(proc: Any) -> str:
    import psutil

    try:
        return " ".join(proc.cmdline())  # setproctitle rewrites the command line
    except psutil.Error:
        return ""


def _set_threads(pid: int, cpus: set[int]) -> int:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit the mask);
    returns how many moved."""
    moved = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone meanwhile
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
            moved += 1
        except OSError:  # a thread that just ended, or a CPU outside its cpuset
            pass
    return moved


def _pinned(procs: list[Any], everything: set[int]) -> set[int]:
    """The CPUs any thread of ``procs`` is pinned to (a strict subset of ``everything``):
    every thread, since OpenMP runtimes pin one compute thread per core."""
    import psutil

    pinned: set[int] = set()
    for proc in procs:
        try:
            threads = [t.id for t in proc.threads()]
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


def _raylet() -> Any:
    """The raylet above this worker (Ray workers are its children), or None."""
    import psutil

    proc = psutil.Process()
    while proc is not None and proc.name() != "raylet":
        proc = proc.parent()
    return proc


def _session_dir(raylet: Any) -> str | None:
    if raylet is None:
        return None
    return next((arg.split("=", 1)[1] for arg in raylet.cmdline()
                 if arg.startswith("--session_dir=")), None)


def _claimed(session: str | None) -> set[int]:
    if not session:
        return set()
    try:
        with open(os.path.join(session, _CLAIMS)) as claims:
            return {int(line) for line in claims if line.strip().isdigit()}
    except OSError:  # nothing claimed yet
        return set()


def _node_processes(raylet: Any) -> list[Any]:
    """This Ray node's processes: the raylet and everything under it (workers, actors, agents,
    HAProxy), and the session's daemons started beside it (GCS, dashboard, monitors: their
    command lines name the session's directory) with theirs."""
    import psutil

    session = _session_dir(raylet)
    roots = [raylet]
    if session:
        for proc in psutil.process_iter():
            if proc.pid != raylet.pid and session in _title(proc):
                roots.append(proc)
    seen: dict[int, Any] = {}
    for root in roots:
        try:
            for proc in [root, *root.children(recursive=True)]:
                seen.setdefault(proc.pid, proc)
        except psutil.Error:
            continue
    return list(seen.values())

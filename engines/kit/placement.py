"""Keep the serving stack off the cores an engine computes on.

vLLM's CPU worker binds its compute threads to cores of its own and leaves the rest ("reserved
CPUs") to everything else, but nothing else is told: Ray's daemons, Serve's controller and
proxy, HAProxy, the replicas and the engine's own scheduler process stay free to run on the
worker's cores. Each of their wake-ups there preempts the forward pass. On a 2-core box with
the embedded model in bf16 that cost the fast layout 12 % of its throughput (250 -> 282 tok/s
with everything moved, alternating on one running gateway; bare vLLM unchanged by the same move;
docs/results/benchmarks-2026-12-07.md).

:func:`place` moves every process of this Ray node, threads included, onto the CPUs no vLLM
worker is pinned to. What computes stays where it is, with everything under it: vLLM's workers,
and the processes that called :func:`claim` (recorded in the session's claims file), which
also run on every CPU again. Pipeline stage actors and the pipeline's origin replica claim for
good. A vLLM replica claims while its engine starts and its own :func:`place` drops the claim:
a Ray worker forked from a raylet that was moved starts on the serving CPUs only, vLLM picks
its worker's cores from the process's affinity, and another engine placing the node meanwhile
must not narrow it. Claims and placements of one node take turns on a file lock; a claim names
the pid and its start time in clock ticks since boot (pids are reused; the wall clock may step).

A vLLM worker is known by its title, and also by where it is: the processes started under a
placing replica since its claim whose threads are pinned to some CPUs only are its engine's
workers, recorded in the session's engines file, so that no later placement moves them even
when vLLM could not set their titles (once in ten starts on a test box both models' processes
kept the title ``python``, and the second model's placement moved the first one's worker onto
the serving CPU; docs/results/benchmarks-2026-12-07.md).

Only inside a Ray worker process (a replica, an actor), never in a driver or a test process;
``LLM_GATEWAY_PLACEMENT=off`` turns it off. Placement never fails a start: an error is logged
and the node runs as it was. A node whose last engine stopped keeps its placement until the
next engine starts and places it again. An operator's own ``taskset`` of Ray's processes is
not kept: a starting engine widens to every CPU the cpuset allows. Only what an engine pinned
(vLLM's CPU workers) counts as an engine: on GPUs (workers not pinned) nothing moves.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from engines.kit.reaper import start_ticks

__all__ = ["COMPUTE_TITLES", "ENGINES", "claim", "claimed", "engine_start", "place", "serving_cpus"]

log = logging.getLogger(__name__)

# Process titles of what computes: never moved by :func:`place`.
COMPUTE_TITLES = ("VLLM::Worker",)
# In the Ray session's directory, one "pid:start time" a line: the processes that claim the CPU,
# and the engines' workers each placing replica found under itself.
_CLAIMS = "llm_gateway_compute_pids"
ENGINES = "llm_gateway_engine_pids"


def enabled() -> bool:
    return os.environ.get("LLM_GATEWAY_PLACEMENT", "on").lower() not in ("off", "0", "false")


def claim() -> set[int]:
    """This process computes (a pipeline stage or origin, a vLLM replica until its engine is
    up): :func:`place` leaves it and what is under it alone, and every thread of it runs on
    every CPU the kernel allows it again (the cpuset intersects the request). Call it before
    torch loads OpenMP, which sizes its pool from this process's CPUs, and before vLLM picks its
    worker's cores. Returns the CPUs this process may use now."""
    if not (enabled() and _in_ray_worker()):
        return set(os.sched_getaffinity(0))
    try:
        session = _session_dir(_raylet())
        if session:
            # Claimed before widened: a placement running now either sees the claim or ran
            # before the widening, never narrows this process after it.
            with _claims(session) as claims:
                claims.add(_key(os.getpid()))
        _set_threads(os.getpid(), set(range(os.cpu_count() or 1)))
    except Exception as exc:  # placement is an optimisation, never a reason to fail
        log.warning("could not claim this process's CPUs: %s", exc)
    return set(os.sched_getaffinity(0))


@contextlib.contextmanager
def engine_start(model: str, pins_own_worker: bool) -> Iterator[None]:
    """The placement step around an engine's start in a replica (``engines.kit.kinds.create_engine``):
    the replica claims every CPU first (it computes, or vLLM is about to pick its worker's cores
    from its affinity); once the engine is up, an engine whose worker pins cores of its own
    (``pins_own_worker``: vLLM on CPU) moves the node's serving processes off them and drops the
    claim, while one that computes in the replica (the pipeline's origin) keeps it. Both moves
    are logged; neither fails the start (the module's doc)."""
    started = _ticks_now()  # what is started under this replica from now on is its engine's
    cpus = claim()
    if enabled() and _in_ray_worker():
        log.info("placement for %s: this replica claims CPUs %s while its engine starts",
                 model, sorted(cpus))
    yield
    if pins_own_worker:
        done = place(engine_since=started)
        if done is None and enabled() and _in_ray_worker():
            log.info("placement for %s: no engine worker pinned to CPUs on this node; "
                     "nothing moved", model)
    elif enabled() and _in_ray_worker():
        log.info("placement for %s: the engine computes in this replica, which keeps its "
                 "claim on CPUs %s", model, sorted(cpus))


def serving_cpus(allowed: set[int], engines: set[int]) -> set[int]:
    """Where the serving stack runs: the allowed CPUs no engine computes on, or all of them
    when engines hold every one (nothing else to go to)."""
    return (allowed - engines) or allowed


def place(engine_since: int | None = None) -> dict[str, Any] | None:
    """Move this node's serving processes off every vLLM worker's cores (see the module's
    doc). With ``engine_since`` (when this replica claimed every CPU for its engine, in clock
    ticks since boot), the pinned processes started under it since then are recorded as its
    engine's workers.
    Returns what it did, or None where it does not apply."""
    if not enabled():
        return None
    try:
        if not _in_ray_worker():
            return None
        raylet = _raylet()
        session = _session_dir(raylet)
        if raylet is None or session is None:
            return None
        # One placement or claim of this node at a time: both take the claims file's lock first.
        with _claims(session) as claims, _claims(session, ENGINES) as engines:
            claims.discard(_key(os.getpid()))  # this replica's engine is up: it serves now
            if engine_since is not None:
                mine = _pinned_under(os.getpid(), engine_since)
                engines.update(mine)
                log.info("this replica's engine workers (processes started under it that pinned "
                         "themselves): %s", sorted(_pids(mine)))
            return _place(raylet, session, claims, _pids(engines))
    except Exception as exc:  # an optimisation, never a reason to fail
        log.warning("could not keep the serving processes off the engine's CPUs: %s", exc)
        return None


def _place(raylet: Any, session: str, claims: set[str],
           recorded: set[int]) -> dict[str, Any] | None:
    """Move ``raylet``'s node off the CPUs its engines' workers (titled, or ``recorded``) are
    pinned to, keeping the workers and the claimants with what runs under them."""
    procs = _node_processes(raylet, session)
    allowed = set(os.sched_getaffinity(0))  # the placing replica claimed every CPU
    workers = [p for p in procs if p.pid in recorded or _title(p).startswith(COMPUTE_TITLES)]
    engines = _pinned(workers, allowed)
    if not engines:
        return None
    keep = {p.pid for p in workers}
    claimants = _pids(claims)  # claims of gone or reused pids were dropped already
    for proc in procs:
        if proc.pid in claimants:
            keep.add(proc.pid)
            keep.update(_pids_under(proc))
    target = serving_cpus(allowed, engines)
    moved = sum(_set_threads(p.pid, target) for p in procs if p.pid not in keep)
    log.info("serving processes (%d threads) moved to CPUs %s, off the engines' %s",
             moved, sorted(target), sorted(engines))
    return {"engine_cpus": sorted(engines), "serving_cpus": sorted(target), "threads": moved}


@contextlib.contextmanager
def _claims(session: str, name: str = _CLAIMS) -> Iterator[set[str]]:
    """The node's claims (or, by ``name``, its recorded engine workers), read and written back
    under an exclusive lock; entries of processes that are gone are dropped."""
    with open(os.path.join(session, name), "a+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            file.seek(0)
            claims = {line.strip() for line in file if line.strip()}
            claims = {c for c in claims if _alive(c)}
            yield claims
            file.seek(0)
            file.truncate()
            file.write("".join(f"{c}\n" for c in sorted(claims)))
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _key(pid: int, ticks: int | None = None) -> str:
    """A process as a claim names it: pid and start time in clock ticks since boot (``ticks``,
    read when not given), since pids are reused (a wall-clock step changes neither)."""
    return f"{pid}:{start_ticks(pid) if ticks is None else ticks}"


def _alive(claim: str) -> bool:
    pid, _, _ = claim.partition(":")
    try:
        return pid.isdigit() and _key(int(pid)) == claim
    except Exception:  # gone (psutil.NoSuchProcess) or unreadable
        return False


def claimed(session: str | None, name: str = _CLAIMS) -> set[int]:
    """The pids that claim the CPU in ``session`` now, or with ``name=ENGINES`` its recorded
    engine workers (for tests and diagnostics)."""
    if not session:
        return set()
    with _claims(session, name) as claims:
        return _pids(claims)


def _pids(claims: set[str]) -> set[int]:
    return {int(c.partition(":")[0]) for c in claims}


def _pinned_under(pid: int, since: int) -> set[str]:
    """The processes started under ``pid`` since ``since`` (clock ticks since boot) with a
    thread pinned to some of its CPUs only, as claims name them: the workers of the engine it
    started. ``pid`` claimed every CPU at ``since``, so what starts under it then inherits
    every CPU and no other placement narrows it; only what pins itself is narrower. A process
    that ends meanwhile is left out."""
    import psutil

    everything = set(os.sched_getaffinity(pid))
    try:
        under = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return set()
    found = set()
    for proc in under:
        ticks = start_ticks(proc.pid)
        if ticks is not None and ticks >= since and _pinned([proc], everything):
            found.add(_key(proc.pid, ticks))
    return found


def _ticks_now() -> int:
    """Now in clock ticks since boot, the clock of a process's start (``start_ticks``)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _pids_under(proc: Any) -> set[int]:
    import psutil

    try:
        return {p.pid for p in proc.children(recursive=True)}
    except psutil.Error:
        return set()


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


def _node_processes(raylet: Any, session: str) -> list[Any]:
    """This Ray node's processes: the raylet and everything under it (workers, actors, agents,
    HAProxy), and the session's daemons started beside it (GCS, dashboard, monitors: their
    command lines name the session's directory) with theirs."""
    import psutil

    roots = [raylet]
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

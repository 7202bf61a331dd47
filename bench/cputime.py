"""CPU time of a server's process tree, split into "engine" and "everything else".

The hardware-robust figure of a serving stack's overhead is the CPU it burns per generated token
outside the model: on a fast engine a fixed per-token cost that hides behind a slow step shows
up in full. A server here is the tree under the process a benchmark started (``serve run``
starts Ray's GCS, raylet, proxy and replica workers as its descendants; vLLM's API server
starts its EngineCore). The engine is vLLM's engine-core and worker processes (vLLM titles them
``VLLM::EngineCore`` and ``VLLM::Worker``; on CPU the model runs in the worker): they run the
scheduler, the model and sampling, the part every server shares. Everything else, vLLM's own
API server process included, is the serving stack.
"""

from __future__ import annotations

import os
import re
import time

import psutil

ENGINE_TITLES = ("VLLM::EngineCore", "VLLM::Worker")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_REPLICA = re.compile(r"ray::ServeReplica:([^:\s]+)")


def _engine_title(proc: psutil.Process) -> str | None:
    """The vLLM title of an engine process, else None. setproctitle rewrites the command line
    and the kernel's 15-character name; a run read some engine processes' command lines as
    plain ``python``, so the name counts too."""
    try:
        words = proc.cmdline()  # setproctitle rewrites the command line
        name = proc.name()
    except psutil.Error:
        return None
    title = " ".join(words)
    return next((t for t in ENGINE_TITLES
                 if title.startswith(t) or (name.startswith("VLLM::") and t.startswith(name))), None)


def _is_engine(proc: psutil.Process) -> bool:
    return _engine_title(proc) is not None


class UnidentifiedEngine(RuntimeError):
    """The tree's vLLM processes cannot all be told apart by their titles: its CPU split would
    count an untitled engine process as serving stack (a round seen so), so it is refused."""


def require_engines(root_pid: int) -> dict[str, int]:
    """The tree's engine processes by title, checked: every vLLM engine is one
    ``VLLM::EngineCore`` and one ``VLLM::Worker`` (on CPU, one worker a core group), so the two
    counts match and are not zero; else :class:`UnidentifiedEngine`."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    counts = dict.fromkeys(ENGINE_TITLES, 0)
    for proc in procs:
        title = _engine_title(proc)
        if title is not None:
            counts[title] += 1
    cores, workers = counts["VLLM::EngineCore"], counts["VLLM::Worker"]
    if not cores or cores != workers:
        raise UnidentifiedEngine(f"{cores} VLLM::EngineCore and {workers} VLLM::Worker titles "
                                 "under the server: an engine process without its title would "
                                 "count as serving stack; the round is refused")
    return counts


def snapshot(root_pid: int) -> dict[int, tuple[bool, float]]:
    """``{pid: (is_engine, user+system CPU seconds)}`` for the tree under ``root_pid``."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out: dict[int, tuple[bool, float]] = {}
    for proc in procs:
        try:
            times = proc.cpu_times()
            out[proc.pid] = (_is_engine(proc), times.user + times.system)
        except psutil.Error:  # exited between listing and reading
            continue
    return out


def spent(before: dict[int, tuple[bool, float]],
          after: dict[int, tuple[bool, float]]) -> dict[str, float]:
    """CPU seconds spent between two snapshots, engine vs the rest. A process born in between
    counts from zero; one that died in between is lost (its last interval is small next to a
    benchmark's)."""
    engine = other = 0.0
    for pid, (is_engine, cpu) in after.items():
        delta = cpu - before.get(pid, (is_engine, 0.0))[1]
        if is_engine:
            engine += delta
        else:
            other += delta
    return {"engine_cpu_s": round(engine, 3), "other_cpu_s": round(other, 3)}


def _label(proc: psutil.Process) -> str:
    """A process's role in a short name: its title as setproctitle left it (Ray names a replica
    ``ray::ServeReplica:<app>:<deployment>``), else its program and script without paths."""
    engine = _engine_title(proc)
    if engine is not None:
        return engine
    try:
        words = proc.cmdline() or [proc.name()]
    except psutil.Error:
        return "?"
    if words[0].startswith("ray::"):
        return re.sub(r"\s.*", "", words[0])
    shown = [os.path.basename(w) for w in words[:3] if not w.startswith("-")]
    return " ".join(shown)[:60] or "?"


def serve_app(proc: psutil.Process) -> str | None:
    """The Serve application ``proc`` works for: that of the nearest replica (Ray titles it
    ``ray::ServeReplica:<app>:<deployment>``) among it and its ancestors. A replica's vLLM
    engine, controller runtime and reaper are its descendants."""
    try:
        for each in (proc, *proc.parents()):
            replica = _REPLICA.match((each.cmdline() or [""])[0])
            if replica:
                return replica.group(1)
    except psutil.Error:
        return None
    return None


def labels(root_pid: int, apart: tuple[str, ...] = ()) -> dict[int, str]:
    """``{pid: role}`` for the tree under ``root_pid`` (``_label``). The processes of a Serve
    application named in ``apart`` get `` @<app>`` after their role: a second model's engine
    and replica then read apart from the first's instead of adding to the same rows (and its
    engine no longer reads as the measured one's, ``ENGINE_TITLES``)."""
    try:
        root = psutil.Process(root_pid)
        procs = (root, *root.children(recursive=True))
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for proc in procs:
        app = serve_app(proc) if apart else None
        out[proc.pid] = _label(proc) + (f" @{app}" if app in apart else "")
    return out


def spent_by_role(before: dict[int, tuple[bool, float]], after: dict[int, tuple[bool, float]],
                  roles: dict[int, str]) -> dict[str, float]:
    """CPU seconds spent between two snapshots per role (``labels``), largest first: where
    the serving stack's share goes."""
    out: dict[str, float] = {}
    for pid, (is_engine, cpu) in after.items():
        role = roles.get(pid, "?")
        out[role] = out.get(role, 0.0) + cpu - before.get(pid, (is_engine, 0.0))[1]
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def box() -> dict[str, float]:
    """The whole box's CPU seconds since boot by kind (``/proc/stat``: user, system, idle,
    steal, ...), summed over its CPUs."""
    return psutil.cpu_times()._asdict()


def box_spent(before: dict[str, float], after: dict[str, float], server_cpu_s: float,
              wall_s: float) -> dict[str, float]:
    """What the box did around one measurement, to tell the box's drift from the server's:
    the share of its CPU time a hypervisor gave other guests (``steal``), and the CPU seconds
    per second that processes outside the server's tree spent (the load generator, anything
    left running). Either moving between rounds moves every server's speed, whatever its
    code (docs/results/benchmarks-2026-12-07.md, "Telling the box's drift from the server's")."""
    delta = {k: after[k] - before[k] for k in after}
    total = sum(delta.values()) or 1.0
    busy = total - delta.get("idle", 0.0) - delta.get("iowait", 0.0) - delta.get("steal", 0.0)
    return {"steal_share": round(delta.get("steal", 0.0) / total, 4),
            "outside_server_cpu_per_s": round(max(busy - server_cpu_s, 0.0) / wall_s, 3)}


def pace(seconds: float = 0.3) -> float:
    """Fixed pure-Python work done in ``seconds`` of wall time on one thread, in millions of
    loop turns a second: the box's speed right now, read while a server idles. A drop
    between rounds that the server's code cannot explain is the box's (a neighbour sharing
    its caches or memory, a clock that moved): every process's CPU per token rises as it drops."""
    turns, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10_000):
            pass
        turns += 10_000
    return round(turns / seconds / 1e6, 2)


def schedstat(pids: list[int]) -> dict[int, tuple[float, float]]:
    """``{pid: (seconds on a CPU, seconds runnable but waiting for one)}`` of each process,
    summed over its threads (``/proc/<pid>/task/<tid>/schedstat``). A thread that busy-waits
    with ``sched_yield``, as vLLM's processes do on their shared-memory queues for a second
    after each read, stays runnable throughout: its wait is then time others ran, not a delay of
    its work, and its CPU is partly the wait itself (docs/results/benchmarks-2026-12-07.md,
    "vLLM's busy wait")."""
    out: dict[int, tuple[float, float]] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # ended meanwhile
            continue
        cpu = wait = 0
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                    on_cpu, waiting = stat.read().split()[:2]
            except (OSError, ValueError):  # a thread that just ended
                continue
            cpu, wait = cpu + int(on_cpu), wait + int(waiting)
        out[pid] = (cpu / 1e9, wait / 1e9)
    return out


def kill_leftovers(tree: dict[int, tuple[bool, float]]) -> None:
    """SIGKILL whatever of an earlier snapshot's processes still runs."""
    for pid in tree:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            continue


def main_threads(pids: list[int]) -> dict[int, tuple[float, int]]:
    """``{pid: (CPU seconds, voluntary context switches)}`` of each process's main thread (its
    thread id is its pid). A Ray worker's main thread runs Ray's task loop, whose 10 ms signal
    check wakes it ~100 times a second whatever the load (docs/results/benchmarks-2026-12-07.md, "Ray's signal
    check and HAProxy's threads")."""
    out: dict[int, tuple[float, int]] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/task/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()  # after "(comm)"
            with open(f"/proc/{pid}/task/{pid}/status") as status:
                switches = next(int(line.split()[1]) for line in status
                                if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):  # ended meanwhile
            continue
        out[pid] = ((int(fields[11]) + int(fields[12])) / _TICKS_PER_S, switches)
    return out

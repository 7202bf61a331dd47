"""Ends an engine's processes when the replica that owns them is gone, however it went.

vLLM runs its EngineCore (and, under it, its workers) as child processes of the replica. A
replica that stops normally shuts them down; one that is killed (``ray stop --force``, ``kill
-9``, the OOM killer) cannot, and nothing else does: they kept running, holding 4.3 GB, after
``ray stop --force`` (docs/reliability.md). So once the engine is up, the replica starts one
small reaper process, in a session of its own (what stops Ray does not stop it), that checks
the replica once a second and, when it is gone, ends the processes it was given: SIGTERM, then
SIGKILL to what is left after ``grace_s``. It exits when they are all gone, whichever way.

Processes are named by pid *and* start time, so a reused pid is never signalled.

    python -m engines.reaper OWNER_PID:START ... -- PID:START ...
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

__all__ = ["main", "start_reaper"]

Named = tuple[int, float]  # pid, start time (psutil's create_time)


def _named(process: psutil.Process) -> str:
    return f"{process.pid}:{process.create_time()!r}"


def start_reaper(pids: list[int], owner: int | None = None) -> subprocess.Popen | None:
    """Watch ``owner`` (default: this process); when it is gone, end ``pids``. Returns the
    reaper process (None when there is nothing to watch)."""
    procs = []
    for pid in pids:
        try:
            procs.append(_named(psutil.Process(pid)))
        except psutil.NoSuchProcess:
            continue
    if not procs:
        return None
    owner_arg = _named(psutil.Process(owner or os.getpid()))
    return subprocess.Popen([sys.executable, "-m", "engines.reaper", owner_arg, "--", *procs],
                            start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _parse(arg: str) -> Named:
    pid, start = arg.split(":", 1)
    return int(pid), float(start)


def _alive(named: Named) -> psutil.Process | None:
    """The process, if it is still the one that was named (and not a zombie)."""
    try:
        process = psutil.Process(named[0])
        if process.create_time() != named[1] or process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _signal(targets: list[Named], sig: int) -> None:
    for process in filter(None, map(_alive, targets)):
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:  # it went by itself meanwhile
            pass


def _end(targets: list[Named], grace_s: float) -> None:
    _signal(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(map(_alive, targets)):
        time.sleep(0.1)
    _signal(targets, signal.SIGKILL)


def watch(owner: Named, targets: list[Named], interval_s: float = 1.0,
          grace_s: float = 5.0) -> bool:
    """Returns True when it ended the targets (the owner went first)."""
    while any(map(_alive, targets)):
        if _alive(owner) is None:
            _end(targets, grace_s)
            return True
        time.sleep(interval_s)
    return False


def main(argv: list[str]) -> int:
    owner, sep, rest = argv[0], argv[1] if len(argv) > 1 else "", argv[2:]
    if sep != "--" or not rest:
        print(__doc__, file=sys.stderr)
        return 2
    watch(_parse(owner), [_parse(arg) for arg in rest])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

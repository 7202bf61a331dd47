"""Ends an engine's processes when the replica that owns them is gone, however it went.

vLLM runs its EngineCore (and, under it, its workers) as child processes of the replica. A
replica that stops normally shuts them down; one that is killed (``ray stop --force``, ``kill
-9``, the OOM killer) cannot, and nothing else does: they kept running, holding 4.3 GB, after
``ray stop --force`` (docs/reliability.md). So before it starts its engine, the replica starts
one small reaper process, in a session of its own (what stops Ray does not stop it). It notes
the replica's descendants once a second while they change (vLLM starts its processes in the first
minute) and less often, at most ``settle_s`` apart, once they stay the same: each look reads every
process's ``/proc`` entry, and a replica that lives for days would otherwise pay for a look every
second. It learns of the replica's end at once from a pidfd, then ends what it noted (SIGTERM,
then SIGKILL to what is left after ``grace_s``) and exits.

A process is named by its pid and its start time in clock ticks since boot (``/proc/<pid>/stat``
field 22): a reused pid is never signalled, and a wall-clock step changes nothing.

    python -m engines.kit.reaper OWNER_PID:START_TICKS
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import psutil

__all__ = ["main", "start_reaper", "start_ticks"]

Named = tuple[int, int]  # pid, start time in clock ticks since boot


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after "(comm)", which may hold ")"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[19])  # field 22 of the whole line


def start_reaper(owner: int | None = None) -> subprocess.Popen | None:
    """Watch ``owner`` (default: this process) from a reaper process; None where there is no
    ``/proc`` to name processes by (not Linux)."""
    owner = owner or os.getpid()
    ticks = start_ticks(owner)
    if ticks is None:
        return None
    return subprocess.Popen([sys.executable, "-m", "engines.kit.reaper", f"{owner}:{ticks}"],
                            start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _alive(named: Named) -> psutil.Process | None:
    """The process, if it is still the one that was named (and not a zombie)."""
    if start_ticks(named[0]) != named[1]:
        return None
    try:
        process = psutil.Process(named[0])
        return None if process.status() == psutil.STATUS_ZOMBIE else process
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _descendants(owner: Named) -> set[Named]:
    try:
        children = psutil.Process(owner[0]).children(recursive=True)
    except psutil.Error:
        return set()
    me = os.getpid()
    named = {(child.pid, start_ticks(child.pid)) for child in children if child.pid != me}
    return {(pid, ticks) for pid, ticks in named if ticks is not None}


def _signal(targets: set[Named], sig: int) -> None:
    for process in filter(None, map(_alive, targets)):
        try:
            process.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # it went by itself meanwhile
            pass


def _end(targets: set[Named], grace_s: float) -> None:
    _signal(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(map(_alive, targets)):
        time.sleep(0.1)
    _signal(targets, signal.SIGKILL)


def _exit_waiter(owner: Named) -> Callable[[float], None]:
    """A wait of at most its argument in seconds that returns early when ``owner`` exits: a
    poll on its pidfd, or a plain sleep where there is none (Linux before 5.3, a seccomp
    filter). The pid's start time is checked after the pidfd is open, so a reused pid is
    never waited on."""
    try:
        fd = os.pidfd_open(owner[0])
    except (AttributeError, OSError):
        return time.sleep
    if start_ticks(owner[0]) != owner[1]:
        os.close(fd)
        return lambda _: None  # gone already: the loop's next liveness check ends it
    poller = select.poll()
    poller.register(fd, select.POLLIN)  # readable once the process has exited

    def wait(timeout_s: float) -> None:
        poller.poll(timeout_s * 1000)
    return wait


def watch(owner: Named, interval_s: float = 1.0, settle_s: float = 5.0,
          grace_s: float = 5.0) -> set[Named]:
    """Until ``owner`` is gone; then ends what it had under it. Returns what it ended. Looks
    every ``interval_s`` while the set changes, doubling the pause to ``settle_s`` while not."""
    wait = _exit_waiter(owner)
    seen: set[Named] = set()
    pause = interval_s
    while _alive(owner) is not None:
        now = {named for named in seen | _descendants(owner) if _alive(named) is not None}
        pause = interval_s if now != seen else min(2 * pause, settle_s)
        seen = now
        wait(pause)
    _end(seen, grace_s)
    return seen


def main(argv: list[str]) -> int:
    try:
        pid, ticks = argv[0].split(":", 1)
        owner = (int(pid), int(ticks))
    except (IndexError, ValueError):
        print(__doc__, file=sys.stderr)
        return 2
    watch(owner)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

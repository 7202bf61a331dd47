"""The reaper (engines/kit/reaper.py) with a real process tree: an "owner" (the replica) with a child
(vLLM's EngineCore) that would outlive it, started before or after the reaper. Killing the owner
with SIGKILL must end the child; a pid whose start time differs is never touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from engines.kit.reaper import _alive, _exit_waiter, start_reaper, start_ticks, watch
from tests.processes import gone_within

# The owner waits for a line on stdin, then starts a child that would outlive it and prints
# the child's pid.
_OWNER = """
import subprocess, sys, time
sys.stdin.readline()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.fixture
def owner():
    process = subprocess.Popen([sys.executable, "-c", _OWNER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    children: list[int] = []

    def start_child() -> int:
        process.stdin.write("go\n")
        process.stdin.flush()
        children.append(int(process.stdout.readline()))
        return children[-1]

    yield process, start_child
    for pid in (process.pid, *children):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


@pytest.mark.parametrize("child_first", [True, False], ids=["child-first", "reaper-first"])
def test_a_killed_owners_processes_are_ended(owner, child_first):
    process, start_child = owner
    child = start_child() if child_first else None
    reaper = start_reaper(process.pid)
    assert reaper is not None
    if child is None:  # like vLLM's EngineCore, which starts after the reaper
        child = start_child()
    time.sleep(4)  # the reaper's second look, at most 2 s after its first, notes the child
    assert not gone_within(child, 0.1)  # the owner lives: its child is left alone
    assert reaper.poll() is None
    process.kill()  # what ray stop --force does to a replica
    process.wait()
    assert gone_within(child, 15), "the orphan outlived its owner"
    assert reaper.wait(15) == 0


def test_a_process_is_known_by_its_start_time_not_only_its_pid():
    me = os.getpid()
    assert _alive((me, start_ticks(me))) is not None
    assert _alive((me, start_ticks(me) + 1)) is None  # a reused pid would look like this
    assert start_ticks(2**22 + 7) is None


def test_a_child_started_after_the_set_settled_is_still_ended(owner):
    """The reaper looks less often while the owner's processes stay the same; a process the
    owner starts after that is noted at the next look, and ended with the others."""
    process, start_child = owner
    ended: list[set] = []
    named = (process.pid, start_ticks(process.pid))
    watcher = threading.Thread(target=lambda: ended.append(
        watch(named, interval_s=0.05, settle_s=0.2, grace_s=2)), daemon=True)
    watcher.start()
    time.sleep(1)  # several looks at an unchanged (empty) set: the pause is at settle_s
    child = start_child()
    time.sleep(1)
    assert watcher.is_alive() and not gone_within(child, 0.1)
    process.kill()
    process.wait()
    watcher.join(15)
    assert ended and child in {pid for pid, _ in ended[0]}
    assert gone_within(child, 5), "the orphan outlived its owner"


def test_the_wait_ends_when_the_owner_exits():
    """The reaper learns of its owner's end from a pidfd, not at its next look."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    wait = _exit_waiter((process.pid, start_ticks(process.pid)))
    done = threading.Event()
    threading.Thread(target=lambda: (wait(120), done.set()), daemon=True).start()
    assert not done.wait(0.5)  # the owner lives: the wait goes on
    process.kill()
    process.wait()
    assert done.wait(30), "the wait outlasted its owner"


def test_a_reused_pid_is_not_waited_on():
    me = os.getpid()
    wait = _exit_waiter((me, start_ticks(me) + 1))  # this pid, but not the process named
    done = threading.Event()
    threading.Thread(target=lambda: (wait(120), done.set()), daemon=True).start()
    assert done.wait(30)

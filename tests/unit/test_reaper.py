"""The reaper (engines/reaper.py) with a real process tree: an "owner" (the replica) with a child
(vLLM's EngineCore) that would outlive it. Killing the owner with SIGKILL must end the child; a
child that ends first lets the reaper exit without touching anything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from engines.reaper import start_reaper

# The owner starts a child that would outlive it, prints the child's pid, then sleeps.
_OWNER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def owner():
    process = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    child = int(process.stdout.readline())
    yield process, child
    for pid in (process.pid, child):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def test_a_killed_owners_processes_are_ended(owner):
    process, child = owner
    reaper = start_reaper([child], owner=process.pid)
    assert reaper is not None
    time.sleep(0.3)
    assert not _gone(child, 0.1)  # the owner lives: its child is left alone
    process.kill()  # what ray stop --force does to a replica
    process.wait()
    assert _gone(child, 10), "the orphan outlived its owner"
    assert reaper.wait(10) == 0


def test_the_reaper_leaves_when_its_processes_end_by_themselves(owner):
    process, child = owner
    reaper = start_reaper([child], owner=process.pid)
    os.kill(child, signal.SIGKILL)
    assert reaper.wait(10) == 0
    assert process.poll() is None  # the owner was never touched


def test_nothing_to_watch_starts_no_reaper():
    assert start_reaper([]) is None
    assert start_reaper([2**22 + 7]) is None  # no such process

"""The serving stack keeps off the CPUs vLLM's worker computes on (``engines/kit/placement.py``):
the engine's CPUs found from the pinned processes under the replica, every thread of a moved
process moved (threads it starts later included), and nothing done outside a Ray worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from engines.kit import placement
from engines.kit.placement import _pinned, serving_cpus
from engines.kit.reaper import start_ticks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                reason="needs two CPUs to move anything")


def test_the_engine_cpus_are_what_a_workers_threads_are_pinned_to():
    # Every thread counts, not the main one alone: OpenMP runtimes pin one compute thread per
    # core.
    cpu = max(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, threading, time
        gate = threading.Event()
        def pinned():
            os.sched_setaffinity(0, {{{cpu}}})
            sys.stdout.write("pinned\\n"); sys.stdout.flush()
            gate.wait()
        threading.Thread(target=pinned, daemon=True).start()
        time.sleep(30)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "pinned\n"
        everything = set(os.sched_getaffinity(0))
        assert _pinned([psutil.Process(child.pid)], everything) == {cpu}
    finally:
        child.kill()
        child.wait()


def test_set_threads_moves_every_thread_and_the_ones_started_later():
    # In a process of its own, as a replica is: moving this one would move pytest.
    script = textwrap.dedent("""
        import os, threading
        from engines.kit.placement import _set_threads
        def mask(tid):
            # A joined thread's id can stay listed a moment after join() returns: gone is fine.
            try:
                return os.sched_getaffinity(tid)
            except ProcessLookupError:
                return set()
        gate = threading.Event()
        # A daemon, so a failed check below ends the process instead of leaving it waiting.
        early = threading.Thread(target=gate.wait, daemon=True); early.start()
        avoid = min(os.sched_getaffinity(0))
        moved = _set_threads(os.getpid(), os.sched_getaffinity(0) - {avoid})
        seen = {}
        late = threading.Thread(target=lambda: seen.update(late=os.sched_getaffinity(0)))
        late.start(); late.join()
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        ok = all(avoid not in mask(t) for t in tids) and avoid not in seen["late"]
        ok = ok and avoid not in mask(early.native_id)
        gate.set(); early.join()
        print(ok, moved, len(tids))
        """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    ok, moved, threads = out.stdout.split()
    assert ok == "True" and int(moved) >= 2 and int(threads) >= 2


def test_the_serving_cpus_are_the_ones_no_engine_holds():
    assert serving_cpus({0, 1, 2, 3}, {0, 1}) == {2, 3}
    assert serving_cpus({0, 1}, {0}) == {1}
    # Engines on every CPU: nowhere else to go, so the serving stack stays everywhere.
    assert serving_cpus({0, 1}, {0, 1}) == {0, 1}


def test_nothing_is_placed_or_widened_outside_a_ray_worker():
    # pytest (a driver at most) keeps its own affinity: an operator's taskset is theirs.
    before = os.sched_getaffinity(0)
    assert placement.place() is None
    assert placement.claim() == before == os.sched_getaffinity(0)


def test_placement_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LLM_GATEWAY_PLACEMENT", "off")
    assert not placement.enabled() and placement.place() is None
    monkeypatch.setenv("LLM_GATEWAY_PLACEMENT", "on")
    assert placement.enabled()


def test_claims_name_live_processes_and_drop_the_gone(tmp_path):
    # A claim is a pid with its start time: a reused pid is not the claimant, and a claim of a
    # process that is gone disappears the next time the node's claims are read.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with placement._claims(str(tmp_path)) as claims:
            claims.add(placement._key(child.pid))
            claims.add(placement._key(os.getpid()))
            claims.add(f"{os.getpid()}:1.0")  # this pid, another start time: not this process
        assert placement.claimed(str(tmp_path)) == {child.pid, os.getpid()}
        with placement._claims(str(tmp_path)) as claims:
            claims.discard(placement._key(os.getpid()))
    finally:
        child.kill()
        child.wait()
    assert placement.claimed(str(tmp_path)) == set()
    assert (tmp_path / placement._CLAIMS).read_text() == ""


_PINS_ITSELF = """
import os, sys, time
os.sched_setaffinity(0, {%d})
sys.stdout.write("pinned\\n"); sys.stdout.flush()
time.sleep(60)
"""


def test_a_replicas_engine_workers_are_the_pinned_processes_started_under_it_since_its_claim():
    # Known by where they are, not by title: what pinned itself under the placing process since
    # it claimed every CPU. A process pinned before then (narrowed by another placement) is not,
    # nor one that pins nothing. Under a stand-in replica of their own: pytest's own children
    # (a test session's Ray node) are not this test's.
    pins = _PINS_ITSELF % max(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from engines.kit.placement import _ticks_now
        def pinned():
            child = subprocess.Popen([sys.executable, "-c", {pins!r}], stdout=subprocess.PIPE,
                                     text=True)
            child.stdout.readline()
            return child
        before = pinned()
        time.sleep(0.05)  # a clock tick (10 ms) or more between it and the claim
        since = _ticks_now()
        worker = pinned()
        free = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(before.pid, since, worker.pid, flush=True)
        time.sleep(60)""")
    replica = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        before, since, worker = (int(x) for x in replica.stdout.readline().split())
        found = placement._pinned_under(replica.pid, since)
        assert found == {f"{worker}:{start_ticks(worker)}"}, (found, before)
    finally:
        _kill_tree(replica)


def test_a_recorded_worker_keeps_its_cpu_whatever_its_title(tmp_path):
    # A node (a stand-in raylet with two processes under it): an untitled worker pinned to one
    # CPU, and a serving process. By title alone no engine is seen and nothing moves; with the
    # worker recorded, the serving process and the raylet move off its CPU and it stays.
    pins = _PINS_ITSELF % max(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        worker = subprocess.Popen([sys.executable, "-c", {pins!r}], stdout=subprocess.PIPE,
                                  text=True)
        worker.stdout.readline()
        server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(worker.pid, server.pid, flush=True)
        time.sleep(60)""")
    root = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker, server = (int(pid) for pid in root.stdout.readline().split())
        raylet, everything = psutil.Process(root.pid), set(os.sched_getaffinity(0))
        engine = {max(everything)}
        assert placement._place(raylet, str(tmp_path), set(), recorded=set()) is None
        done = placement._place(raylet, str(tmp_path), set(), recorded={worker})
        assert done is not None and done["engine_cpus"] == sorted(engine)
        for pid in (root.pid, server):
            assert os.sched_getaffinity(pid) == everything - engine
        assert os.sched_getaffinity(worker) == engine
    finally:
        _kill_tree(root)


def _kill_tree(root: subprocess.Popen) -> None:
    for proc in psutil.Process(root.pid).children(recursive=True):
        proc.kill()
    root.kill()
    root.wait()

"""bench/cputime.py: a process tree's CPU time, vLLM's engine processes apart from the rest."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from bench import cputime

BURN = """
import sys, time
if sys.argv[1]:
    import setproctitle
    setproctitle.setproctitle(sys.argv[1])
open(sys.argv[2], "w").close()
end = time.process_time() + 0.4
while time.process_time() < end:
    pass
time.sleep(30)
"""


def _wait_for(path, deadline_s: float = 20) -> None:
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        assert time.monotonic() < deadline, "child did not start"
        time.sleep(0.05)


def test_engine_and_serving_cpu_are_told_apart(tmp_path):
    # A parent (the "server") with two busy children: one titled as vLLM titles its worker.
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = cputime.snapshot(parent.pid)
        children = [subprocess.Popen([sys.executable, "-c", BURN, title, str(tmp_path / name)])
                    for title, name in (("VLLM::Worker", "engine"), ("", "other"))]
        # The children are this test's, not the sleeper's: measure each tree and add them up.
        try:
            for name in ("engine", "other"):
                _wait_for(tmp_path / name)
            time.sleep(0.8)  # both finished their 0.4 s of CPU
            spent = {"engine_cpu_s": 0.0, "other_cpu_s": 0.0}
            for child in children:
                got = cputime.spent({}, cputime.snapshot(child.pid))
                for key in spent:
                    spent[key] += got[key]
        finally:
            for child in children:
                child.kill()
        assert 0.35 <= spent["engine_cpu_s"] < 1.5, spent
        assert 0.35 <= spent["other_cpu_s"] < 1.5, spent
        idle = cputime.spent(before, cputime.snapshot(parent.pid))
        assert idle["engine_cpu_s"] == 0 and idle["other_cpu_s"] < 0.2, idle
    finally:
        parent.kill()


def test_a_process_gone_from_the_tree_yields_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert cputime.snapshot(proc.pid) == {}


def test_cpu_is_told_apart_by_the_role_each_process_title_names(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", BURN, "ray::ServeReplica:gateway:Ingress x",
                              str(tmp_path / "ingress")])
    try:
        _wait_for(tmp_path / "ingress")
        time.sleep(0.8)
        roles = cputime.labels(child.pid)
        by_role = cputime.spent_by_role({}, cputime.snapshot(child.pid), roles)
    finally:
        child.kill()
    assert roles == {child.pid: "ray::ServeReplica:gateway:Ingress"}
    assert 0.35 <= by_role["ray::ServeReplica:gateway:Ingress"] < 1.5, by_role


def test_a_main_threads_cpu_and_wakeups_are_its_own(tmp_path):
    # The child burns 0.4 s on its main thread, then sleeps; a helper thread only sleeps.
    script = ("import threading, time\n"
              "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n" + BURN)
    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", script, "", str(started)])
    try:
        _wait_for(started)
        before = cputime.main_threads([proc.pid])
        time.sleep(1.0)  # the burn (0.4 s of CPU) is over
        cpu, switches = cputime.main_threads([proc.pid])[proc.pid]
        assert 0.3 <= cpu - before[proc.pid][0] <= 1.0
        assert switches >= before[proc.pid][1]
    finally:
        proc.kill()
        proc.wait()
    assert cputime.main_threads([proc.pid]) == {}


def test_the_box_reading_tells_steal_apart_from_the_cpu_outside_the_server():
    before = {"user": 10.0, "system": 0.0, "idle": 10.0, "iowait": 0.0, "steal": 0.0}
    after = {"user": 13.0, "system": 1.0, "idle": 14.0, "iowait": 0.0, "steal": 2.0}
    # 10 s of the box's CPU time: 4 busy (1 of them the server's), 4 idle, 2 stolen, over 2 s.
    got = cputime.box_spent(before, after, server_cpu_s=1.0, wall_s=2.0)
    assert got == {"steal_share": 0.2, "outside_server_cpu_per_s": 1.5}


def test_the_box_reading_since_boot_has_every_kind_the_split_needs():
    reading = cputime.box()
    assert {"user", "system", "idle"} <= reading.keys()
    assert cputime.pace(0.05) > 0


def test_an_engine_process_named_only_in_the_kernel_still_counts_as_the_engine(tmp_path):
    # Its command line stays `python -c ...`; only the kernel's 15-character name is vLLM's.
    ready = tmp_path / "named"
    code = ("import sys, time\nopen('/proc/self/comm', 'w').write('VLLM::EngineCore')\n"
            "open(sys.argv[1], 'w').close()\ntime.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code, str(ready)])
    try:
        _wait_for(ready)
        assert cputime.snapshot(child.pid)[child.pid][0] is True
        assert cputime.labels(child.pid)[child.pid] == "VLLM::EngineCore"
    finally:
        child.kill()


def test_a_second_applications_processes_read_apart_from_the_first_ones(tmp_path):
    # A "replica" of application model-1 whose child is titled as vLLM titles its worker, and
    # a replica of model-0 beside it: with model-1 apart, its worker is no longer the engine's
    # row (the measured model's), and neither process adds to model-0's rows.
    spawn = ("import subprocess, sys\n"
             "child = subprocess.Popen([sys.executable, '-c', sys.argv[3], sys.argv[4],"
             " sys.argv[5]])\n" + BURN)
    ready = {name: tmp_path / name for name in ("replica", "worker", "other")}
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    replica = subprocess.Popen([sys.executable, "-c", spawn, "ray::ServeReplica:model-1:engine-x",
                                str(ready["replica"]), BURN, "VLLM::Worker", str(ready["worker"])])
    other = subprocess.Popen([sys.executable, "-c", BURN, "ray::ServeReplica:model-0:engine-y",
                              str(ready["other"])])
    try:
        for path in ready.values():
            _wait_for(path)
        worker = psutil.Process(replica.pid).children()[0].pid
        got = {**cputime.labels(replica.pid, apart=("model-1",)),
               **cputime.labels(other.pid, apart=("model-1",))}
        plain = cputime.labels(replica.pid)
    finally:
        for proc in (parent, replica, other):
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
    assert got == {replica.pid: "ray::ServeReplica:model-1:engine-x @model-1",
                   worker: "VLLM::Worker @model-1",
                   other.pid: "ray::ServeReplica:model-0:engine-y"}
    assert plain[worker] == "VLLM::Worker"


# A server stand-in: one child per title given (empty: left untitled), as vLLM starts its
# engine-core and worker under the process that serves.
SERVER = """
import subprocess, sys, time
child = "import setproctitle, sys, time\\nif sys.argv[1]: setproctitle.setproctitle(sys.argv[1])\\n" \\
        "open(sys.argv[2], 'w').close()\\ntime.sleep(30)"
kids = [subprocess.Popen([sys.executable, "-c", child, title, f"{sys.argv[1]}.{i}"])
        for i, title in enumerate(sys.argv[2:])]
time.sleep(30)
"""


def _server(tmp_path, *titles: str) -> subprocess.Popen:
    ready = tmp_path / f"server{len(list(tmp_path.iterdir()))}"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(ready), *titles])
    for i in range(len(titles)):
        _wait_for(tmp_path / f"{ready.name}.{i}")
    return server


def test_a_tree_whose_engine_processes_lack_their_titles_is_refused(tmp_path):
    """A round whose vLLM processes cannot all be named is refused rather than split: an
    untitled worker's CPU would count as serving stack (a round seen so)."""
    servers = [_server(tmp_path, "VLLM::EngineCore", "VLLM::Worker"),
               _server(tmp_path, "VLLM::EngineCore", ""), _server(tmp_path, "", "")]
    try:
        assert cputime.require_engines(servers[0].pid) == {"VLLM::EngineCore": 1,
                                                           "VLLM::Worker": 1}
        with pytest.raises(cputime.UnidentifiedEngine, match="1 VLLM::EngineCore and 0"):
            cputime.require_engines(servers[1].pid)
        with pytest.raises(cputime.UnidentifiedEngine, match="0 VLLM::EngineCore and 0"):
            cputime.require_engines(servers[2].pid)
    finally:
        for server in servers:
            for child in psutil.Process(server.pid).children(recursive=True):
                child.kill()
            server.kill()

"""The serving stack runs off the cores vLLM's worker computes on (``engines/kit/placement.py``):
Ray's daemons, Serve's controller and proxy, the replicas, vLLM's scheduler process and the
controller runtime's process (the replica's child), every thread of each, in the test session's
Ray node with its real vLLM replica. The oracle is the kernel's own affinity of each thread
(psutil / sched_getaffinity), against the CPUs the worker's threads are pinned to. Also what
``gateway/serve_env.py`` sets for the processes it does not place: the engine's priority,
HAProxy's threads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import psutil
import pytest

from engines.kit.placement import ENGINES, _session_dir, claimed
from tests.e2e.conftest import MODEL

T = TypeVar("T")
RUNTIME = "-m engines.controllers.runtime.process"  # the controller runtime's command line


def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _per_thread(proc: psutil.Process, read: Callable[[int], T]) -> list[T]:
    """``read(thread id)`` for every thread of ``proc`` that is still there."""
    out = []
    try:
        threads = proc.threads()
    except psutil.Error:
        return out
    for thread in threads:
        try:
            out.append(read(thread.id))
        except OSError:  # ended meanwhile
            continue
    return out


def _threads_cpus(proc: psutil.Process) -> list[set[int]]:
    return _per_thread(proc, lambda tid: set(os.sched_getaffinity(tid)))


def test_the_serving_processes_run_off_the_cpus_vllms_worker_computes_on(openai_client):
    # A controlled request: the engine, its scheduler and the controller runtime are all up.
    out = openai_client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
        extra_body={"controller": "llguidance",
                    "controller_arg": {"grammar": {"grammars": [{"lark_grammar":
                                                                 "start: /[a-z ]{4,}/"}]}}})
    assert out.choices[0].text
    me = psutil.Process()
    raylets = [p for p in me.children(recursive=True) if p.name() == "raylet"]
    assert raylets, "the session's Ray node runs under this process"
    node = [p for r in raylets for p in (r, *r.children(recursive=True))]
    node += [p for p in me.children(recursive=True) if p.name() == "gcs_server"]
    workers = [p for p in node if _title(p).startswith("VLLM::Worker")]
    assert workers, "a vLLM worker runs in the session's node"
    everything = set(os.sched_getaffinity(0))
    pinned = set().union(*(c for w in workers for c in _threads_cpus(w) if c < everything))
    if not pinned:
        pytest.skip("vLLM's worker is not pinned on this machine (a GPU box): nothing to keep off")
    # A pipeline's origin replica claims its process as computing, and so does a vLLM replica
    # while its engine starts: each stays where it is with what runs under it.
    kept = set()
    for pid in set().union(*(claimed(_session_dir(r)) for r in raylets)):
        kept |= {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    serving = [p for p in node if p.pid not in kept and (
               _title(p).startswith(("ray::ServeController", "ray::ProxyActor",
                                        "ray::ServeReplica", "VLLM::EngineCore"))
               or RUNTIME in _title(p) or p.name() in ("raylet", "gcs_server"))]
    # Ray appends the running method to an actor's title (``ray::ServeController.listen_for_
    # change``), so an actor is known by its title's prefix
    titles = [_title(p) for p in serving]
    for name in ("ray::ServeController", "VLLM::EngineCore"):
        assert any(t.startswith(name) for t in titles), (name, titles)
    assert any(RUNTIME in t for t in titles), titles  # the replica's child
    for proc in serving:
        for cpus in _threads_cpus(proc):
            assert not cpus & pinned, (_title(proc)[:60], cpus, pinned)
    for worker in workers:  # the engine itself is where vLLM put it
        assert any(c <= pinned for c in _threads_cpus(worker))
    # and is known by where it is too (its replica recorded it), not only by its title
    recorded = set().union(*(claimed(_session_dir(r), ENGINES) for r in raylets))
    assert {w.pid for w in workers} <= recorded, (recorded, [w.pid for w in workers])
    # The placement step is in the engine replica's log lines, where an operator looks: Serve
    # writes them to the worker's stderr file at once, and to the replica's file under serve/
    # (buffered), both tagged with the replica's deployment.
    lines = [line for r in raylets for line in _log_lines(os.path.join(_session_dir(r), "logs"))
             if f"engine-{MODEL}" in line]
    assert any(f"placement for {MODEL}: this replica claims CPUs" in line for line in lines)
    assert any("serving processes" in line and "moved to CPUs" in line for line in lines)
    assert any("this replica's engine workers" in line for line in lines)


def _log_lines(folder: str) -> list[str]:
    paths = [os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".err")]
    serve = os.path.join(folder, "serve")
    paths += [os.path.join(serve, name) for name in os.listdir(serve)
              if name.startswith("replica_")]
    lines = []
    for path in paths:
        with open(path, errors="replace") as f:
            lines += f.readlines()
    return lines


def _threads_nice(proc: psutil.Process) -> list[int]:
    return _per_thread(proc, lambda tid: os.getpriority(os.PRIO_PROCESS, tid))


def test_the_engine_runs_at_the_priority_of_rays_daemons(openai_client):
    # Ray starts its workers at nice 15 unless told otherwise (gateway/serve_env.py sets
    # RAY_worker_niceness=0); vLLM's scheduler and worker inherit it from their replica and
    # would lose every wake-up to the daemons and to anything else on the box.
    assert openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                            temperature=0).choices[0].text is not None
    me = psutil.Process()
    raylet = next(p for p in me.children(recursive=True) if p.name() == "raylet")
    daemon_nice = raylet.nice()
    engine = [p for p in raylet.children(recursive=True)
              if _title(p).startswith(("VLLM::Worker", "VLLM::EngineCore", "ray::ServeReplica"))]
    titles = [_title(p) for p in engine]
    for name in ("VLLM::Worker", "VLLM::EngineCore"):
        assert any(t.startswith(name) for t in titles), (name, titles)
    for proc in engine:
        nices = _threads_nice(proc)
        assert nices and set(nices) == {daemon_nice}, (_title(proc)[:60], set(nices), daemon_nice)


def test_haproxy_runs_the_threads_its_node_was_given(openai_client):
    # gateway/serve_env.py gives HAProxy one thread on a node of at most 4 CPUs (Serve starts
    # 4 whatever the node); the session's environment holds what this node was given.
    assert openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                            temperature=0).choices[0].text is not None
    expected = int(os.environ.get("RAY_SERVE_HAPROXY_NBTHREAD", "4"))
    if len(os.sched_getaffinity(0)) <= 4:
        assert expected == 1
    raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == "raylet")
    haproxies = [p for p in raylet.children(recursive=True) if p.name() == "haproxy"]
    assert haproxies, "the session's HAProxy runs under its Ray node"
    assert {p.num_threads() for p in haproxies} == {expected}

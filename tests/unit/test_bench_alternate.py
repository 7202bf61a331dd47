"""bench/alternate.py's pure parts: settings as written on its command line, the ABBA order of
the loads, where each setting runs vLLM's scheduler, schedstat read per output token, and the
summary; and ``cputime.schedstat`` on a real process."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from bench import alternate, cputime
from bench.alternate import Engine, Setting, abba, parse_setting, per_token, scheduler_cpus


def test_settings_parse_and_refuse_what_they_cannot_apply():
    assert parse_setting("cpus=worker") == Setting("cpus", "worker")
    assert parse_setting("nice=-05").name == "nice=-5"
    assert parse_setting("second=absent") == Setting("second", "absent")
    for bad in ("cpus=two", "nice=20", "nice=-21", "nice=x", "affinity=0", "cpus",
                "second=idle"):
        with pytest.raises(ValueError, match="expected cpus="):
            parse_setting(bad)


def test_a_negative_niceness_is_refused_before_a_server_starts_unless_root(monkeypatch):
    settings = [parse_setting("nice=0"), parse_setting("nice=-10")]
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="nice=-10: a negative niceness needs root"):
        alternate.refuse_unprivileged_niceness(settings)
    alternate.refuse_unprivileged_niceness([parse_setting("nice=5"), parse_setting("cpus=all")])
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    alternate.refuse_unprivileged_niceness(settings)


def test_taking_the_second_model_away_is_refused_where_there_is_none():
    settings = [parse_setting("second=present"), parse_setting("second=absent")]
    with pytest.raises(SystemExit, match="needs --target gateway-two-apps"):
        alternate.refuse_second_without_two_apps(settings, "gateway")
    alternate.refuse_second_without_two_apps(settings, "gateway-two-apps")
    alternate.refuse_second_without_two_apps([parse_setting("cpus=all")], "gateway")


def test_loads_run_forward_then_backward_so_a_linear_drift_cancels():
    a, b = Setting("cpus", "serving"), Setting("cpus", "worker")
    assert abba([a, b], 3) == [a, b, b, a, a, b]
    assert abba([a], 2) == [a, a]
    assert abba([a, b], 2, visit=2) == [a, a, b, b, b, b, a, a]


def _engine(worker=frozenset({0}), placed=frozenset({1})) -> Engine:
    return Engine(scheduler=10, titles={10: "VLLM::EngineCore", 11: "VLLM::Worker"},
                  worker_cpus=worker, placed_cpus=placed, placed_nice=0)


def test_each_setting_places_the_scheduler():
    every = {0, 1, 2, 3}
    engine = _engine(worker=frozenset({0, 1}), placed=frozenset({2, 3}))
    assert scheduler_cpus(Setting("cpus", "serving"), engine, every) == {2, 3}
    assert scheduler_cpus(Setting("cpus", "worker"), engine, every) == {0, 1}
    assert scheduler_cpus(Setting("cpus", "all"), engine, every) == every
    # A niceness setting leaves the scheduler where the server put it.
    assert scheduler_cpus(Setting("nice", "-5"), engine, every) == {2, 3}
    # A worker on every CPU leaves nowhere else to serve from: the scheduler keeps them all.
    assert scheduler_cpus(Setting("cpus", "serving"), _engine(worker=frozenset(every)),
                          every) == every


def test_schedstat_per_output_token_by_engine_title():
    before = {10: (1.0, 2.0), 11: (5.0, 0.5)}
    after = {10: (1.5, 2.25), 11: (6.0, 0.5), 12: (0.1, 0.0)}  # 12: a process born meanwhile
    titles = {10: "VLLM::EngineCore", 11: "VLLM::Worker", 12: "VLLM::Worker"}
    got = per_token(before, after, titles, tokens=1000)
    assert got == {"VLLM::EngineCore": {"cpu": 0.5, "wait": 0.25},
                   "VLLM::Worker": {"cpu": 1.1, "wait": 0.0}}


def test_schedstat_reads_a_live_process_and_skips_a_gone_one():
    end = time.process_time() + 0.05
    while time.process_time() < end:  # some CPU of our own to read back
        pass
    got = cputime.schedstat([os.getpid(), 2**22 + 7])  # the second pid is past pid_max
    cpu, wait = got[os.getpid()]
    assert cpu >= 0.05 and wait >= 0.0
    assert list(got) == [os.getpid()]


def _row(setting, rate, sched_cpu, client=0.4):
    return {"setting": setting, "output_throughput": rate, "failed": 0,
            "engine_sched_ms_per_token": {"VLLM::EngineCore": {"cpu": sched_cpu, "wait": 0.3},
                                          "VLLM::Worker": {"cpu": 0.6, "wait": 0.1}},
            "ms_per_token": {"VLLM::EngineCore": sched_cpu, "VLLM::Worker": 0.6,
                             "haproxy": 0.05, "ray::ServeReplica:m:engine": 0.2},
            "client_ms_per_token": client}


def test_summary_compares_each_setting_with_the_first():
    rows = [_row("cpus=serving", 100, 0.4), _row("cpus=worker", 110, 0.1),
            _row("cpus=worker", 130, 0.1), _row("cpus=serving", 120, 0.4)]
    args = SimpleNamespace(target="gateway", model="tiny", concurrency=16, num_prompts=512, visit=1,
                           client="realtime")
    text = alternate.summarize(rows, args)
    line = next(x for x in text.splitlines() if x.startswith("| cpus=worker |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:4] == ["110.0, 130.0", "120.0", "1.091x"]  # 120 / 110
    assert cells[4] == "0.100 / 0.300" and cells[5] == "0.600"
    assert cells[6] == "0.250"  # HAProxy and the replica: outside the engine
    assert "Failed requests: 0" in text
    # neighbours 1-2 and 3-4: 110/100 and 130/120, so the box's drift between pairs cancels
    assert "Paired loads (2 pairs of neighbours): cpus=worker vs cpus=serving 1.092x" in text
    assert "standard error 0.008" in text


def test_paired_ratios_need_two_settings_and_two_pairs():
    two = [_row("a", 100, 0.4), _row("b", 90, 0.4), _row("b", 99, 0.4), _row("a", 110, 0.4)]
    got = alternate.paired(two)
    assert (got.first, got.second) == ("a", "b")
    assert got.pairs == 2 and abs(got.mean - 0.9) < 1e-9 and got.error < 1e-9
    assert alternate.paired(two[:2]) is None  # one pair: no spread to read
    assert alternate.paired([_row("a", 100, 0.4)] * 4) is None


def test_with_visits_of_several_loads_each_load_pairs_with_its_like_in_the_next_visit():
    rows = [_row(s, rate, 0.4) for s, rate in
            [("a", 100), ("a", 200), ("b", 90), ("b", 180), ("b", 99), ("b", 198), ("a", 110),
             ("a", 220), ("a", 500)]]  # the last visit has no neighbour: left out
    got = alternate.paired(rows, visit=2)
    assert got.pairs == 4 and abs(got.mean - 0.9) < 1e-9 and got.error < 1e-9


def test_the_engine_is_found_by_title_and_two_models_are_refused(monkeypatch):
    me, parent = os.getpid(), os.getppid()
    monkeypatch.setattr(cputime, "labels", lambda root, apart=(): {
        1: "python serve run", me: "VLLM::EngineCore", parent: "VLLM::Worker",
        3: "VLLM::EngineCore @model-1"})  # a second model's engine is not the measured one
    engine = alternate.find_engine(1)
    assert engine.scheduler == me and set(engine.titles) == {me, parent}
    assert engine.worker_cpus == frozenset(os.sched_getaffinity(parent))
    assert engine.placed_cpus == frozenset(os.sched_getaffinity(me))
    assert engine.placed_nice == os.getpriority(os.PRIO_PROCESS, me)
    monkeypatch.setattr(cputime, "labels", lambda root, apart=(): {
        me: "VLLM::EngineCore", 2: "VLLM::EngineCore", parent: "VLLM::Worker"})
    with pytest.raises(SystemExit, match="expected one vLLM scheduler"):
        alternate.find_engine(1)

"""bench/compare.py's summary: rounds averaged per server, ratios against bare vLLM, CPU per 1k
tokens summed over rounds (not averaged per round)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from bench.compare import summarize


def _row(target, rnd, tput, other, tokens=1000, conc=16):
    return {"model": "m", "target": target, "round": rnd, "concurrency": conc,
            "output_throughput": tput, "median_ttft_ms": 100.0, "median_tpot_ms": 10.0,
            "other_cpu_s": other, "engine_cpu_s": 2.0, "total_output_tokens": tokens,
            "idle_other_cpu_s": 0.25}


def test_ratios_and_cpu_per_thousand_tokens():
    rows = [_row("bare", 0, 100, 0.5), _row("bare", 1, 120, 0.5),
            _row("gateway", 0, 90, 3.0), _row("gateway", 1, 108, 1.0, tokens=3000)]
    text = summarize(rows, SimpleNamespace(backend="openai", hog=False))
    gateway = next(line for line in text.splitlines() if line.startswith("| 16 | gateway |"))
    cells = [c.strip() for c in gateway.strip("|").split("|")]
    assert cells[2] == "90.0, 108.0" and cells[3] == "99.0"
    assert cells[4] == "0.900x"  # 99 / 110
    assert cells[7] == "1.00"  # (3 + 1) s over 4,000 tokens
    assert cells[9] == "0.25"
    assert "2 rounds" in text and "Machine:" in text


def test_the_protocol_bench_imports_and_starts_only_layouts_compare_knows():
    # bench/protocols.py reuses bench/servers.py's starters; a rename once broke its import.
    from bench import protocols, servers
    assert set(protocols.LAYOUTS.values()) <= set(servers.STARTERS)
    assert {protocols.LAYOUTS[k] for k in ("default", "fast")} == {
        "gateway", "gateway-colocated-haproxy"}


def test_the_controller_benches_import():
    # they reuse bench/pipeline.py's _cpu_flags; an import error would only show when measuring
    from bench import controlled_throughput, controllers, pipeline_kernels
    assert controlled_throughput.REGEX["grammar"]["grammars"][0]["lark_grammar"]
    assert callable(controllers.measure)
    # the kernels bench's point: every sequence's prompt has a length of its own
    lengths = {len(pipeline_kernels.prompt(i).split()) for i in range(pipeline_kernels.SEQUENCES)}
    assert len(lengths) == pipeline_kernels.SEQUENCES


def test_the_stall_bench_uses_compare_s_helpers_that_exist():
    # bench/stall.py reuses the servers' and the load generator's helpers; a rename there would
    # only show when measuring.
    from bench import load, servers, stall
    for name in ("wait_ready", "stop", "venv_bin", "models", "start_hog"):
        assert callable(getattr(servers, name)), name
    assert callable(load.run_load) and callable(load.client_priority)
    assert "gateway-colocated-haproxy" in servers.STARTERS and "bare" in servers.STARTERS
    threads = stall._schedstat({os.getpid(): "pytest"})
    comm, run_ns, wait_ns, slices = threads[(os.getpid(), os.getpid())]
    assert run_ns > 0 and wait_ns >= 0 and slices > 0 and comm


def test_the_load_generator_runs_at_the_priority_it_was_granted(monkeypatch, capsys):
    import subprocess
    import sys

    from bench import load
    assert load.client_priority("normal") == "normal"

    # Granted (root / CAP_SYS_NICE): a child started with the hook runs SCHED_FIFO.
    if load.client_priority("realtime") == "realtime":
        policy = subprocess.run(
            [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
            preexec_fn=load.realtime, capture_output=True, text=True, check=True).stdout
        assert int(policy) == os.SCHED_FIFO

    # Refused: the bench measures at normal priority, says so, and the rows record it.
    def refuse(*_):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(load.os, "sched_setscheduler", refuse)
    assert load.client_priority("realtime") == "normal"
    assert "normal priority" in capsys.readouterr().err
    rows = [_row("bare", 0, 100, 0.5) | {"client": "realtime"}, _row("gateway", 0, 90, 1.0)]
    text = summarize(rows, SimpleNamespace(backend="openai", hog=True))
    assert "load generator at normal / realtime priority" in text


def test_the_stall_bench_sums_cpu_per_process_most_first():
    from bench import stall
    before = {(1, 1): ("a", 0, 0, 0), (1, 2): ("b", 0, 0, 0), (2, 2): ("c", 0, 0, 0)}
    after = {(1, 1): ("a", 5_000_000, 1_000_000, 3), (1, 2): ("b", 7_000_000, 0, 1),
             (2, 2): ("c", 20_000_000, 2_000_000, 9), (3, 3): ("born later", 9_000_000, 1_000_000, 2)}
    pids = {1: "proxy", 2: "replica", 3: "x"}
    rows = stall._threads(pids, before, after)
    assert {r["thread"] for r in rows} == {"a", "b", "c"}  # no baseline, no row
    # ... unless its process started between the readings: then it counts from zero
    born = stall._threads(pids, before, after, frozenset({3}))
    assert {r["thread"]: r["run_ms"] for r in born}["born later"] == 9
    assert stall._per_process(rows) == [
        {"process": "replica", "run_ms": 20, "wait_ms": 2},
        {"process": "proxy", "run_ms": 12, "wait_ms": 1}]
    assert stall._label(["/v/bin/python", "/v/ray/dashboard/dashboard.py", "--x"], "python") \
        == "python dashboard.py --x"
    assert stall._label(["ray::ServeReplica:app:Gateway"], "ray::Serve") \
        == "ray::ServeReplica:app:Gateway"


def test_the_protocol_bench_rotates_the_path_order_and_reports_cpu_per_path():
    import argparse

    from bench import protocols
    paths = ["openai", "lmtp", "lmi"]
    assert [protocols.rotated(paths, r) for r in (1, 2, 3, 4)] == [
        ["openai", "lmtp", "lmi"], ["lmtp", "lmi", "openai"], ["lmi", "openai", "lmtp"],
        ["openai", "lmtp", "lmi"]]
    rows = [{"protocol": p, "tokens": 2000, "tok_per_s": tps, "median_ttft_ms": 100.0,
             "client_cpu_s": 1.0, "other_cpu_s": cpu, "engine_cpu_s": 9.0}
            for p, tps, cpu in (("openai", 100.0, 2.0), ("openai", 100.0, 2.0),
                                ("lmi", 95.0, 3.0), ("lmi", 97.0, 5.0))]
    args = argparse.Namespace(num_prompts=64, concurrency=16, rounds=2, client="realtime",
                              paths=["openai", "lmi"])
    table = protocols.summarize(rows, args)
    lmi = next(line for line in table.splitlines() if line.startswith("| LMI"))
    cells = [c.strip() for c in lmi.strip("|").split("|")]
    assert cells[1:] == ["96.0", "100", "0.960x", "2.00", "0.50"]  # (3 + 5) s / 4k tok
    assert "rotated" in table and "realtime" in table and "Machine:" in table


def test_every_bench_script_imports():
    """A bench's imports only show they broke when somebody measures (bench/bursts.py imported
    names that a split of bench/reliability.py had moved, for days): import each one here."""
    import importlib
    from pathlib import Path

    scripts = sorted(p.stem for p in (Path(__file__).parents[2] / "bench").glob("*.py")
                     if p.stem != "__init__")
    assert "bursts" in scripts and len(scripts) > 10
    for name in scripts:
        importlib.import_module(f"bench.{name}")


def test_the_reliability_bench_reads_what_is_wrong_off_every_scenario():
    from bench import reliability

    clean = {"soak": {"engine_idle_after_s": 0.5, "ingress_rss_mb_before": 300,
                      "ingress_rss_mb_after": 310},
             "overload": {"streams": {"statuses": {"200": 90, "429": 10},
                                      "retry_after": {"429": {"with": 10, "without": 0}}}},
             "replica_death": {"streams": {"openai": {"outcome": "error in shape"}},
                               "recovered_after_s": 40.0}}
    assert reliability.findings(clean) == []
    broken = {"soak": {"5xx": 2, "engine_idle_after_s": None},
              "overload": {"plain": {"statuses": {"200": 5, "500": 1}, "500s": 1,
                                     "retry_after": {"503": {"with": 0, "without": 3}}}},
              "slow_reader": {"streams": 64, "complete_streams": 60, "socket_usable_after": True},
              "replica_death": {"streams": {"tgi": {"outcome": "hang"}}, "recovered_after_s": None},
              "lmtp_flood": {"error": "the socket closed"}}
    found = reliability.findings(broken)
    for expected in ("soak: 2 5xx", "soak: the engine still had requests in flight",
                     "overload/plain: statuses", "overload/plain: unexpected outcomes",
                     "overload/plain: refusals without Retry-After", "slow_reader: 60/64",
                     "replica_death/tgi", "replica_death: no 200", "lmtp_flood: the scenario failed"):
        assert any(line.startswith(expected) for line in found), (expected, found)

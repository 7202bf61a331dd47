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
    # bench/protocols.py reuses compare.py's starters; a rename there once broke its import.
    from bench import compare, protocols
    assert set(protocols.LAYOUTS.values()) <= set(compare.STARTERS)
    assert {protocols.LAYOUTS[k] for k in ("default", "fast")} == {
        "gateway", "gateway-colocated-haproxy"}


def test_the_controller_benches_import():
    # they reuse bench/pipeline.py's _cpu_flags; an import error would only show when measuring
    from bench import controlled_throughput, controllers
    assert controlled_throughput.REGEX["grammar"]["grammars"][0]["lark_grammar"]
    assert callable(controllers.measure)


def test_the_stall_bench_uses_compare_s_helpers_that_exist():
    # bench/stall.py reuses compare.py's starters and private helpers; a rename there would only
    # show when measuring.
    from bench import compare, stall
    for name in ("_wait_ready", "_bench", "_stop", "_bin", "_models", "_hog"):
        assert callable(getattr(compare, name)), name
    assert "gateway-colocated-haproxy" in compare.STARTERS and "bare" in compare.STARTERS
    threads = stall._schedstat({os.getpid(): "pytest"})
    comm, run_ns, wait_ns, slices = threads[(os.getpid(), os.getpid())]
    assert run_ns > 0 and wait_ns >= 0 and slices > 0 and comm


def test_the_load_generator_runs_at_the_priority_it_was_granted(monkeypatch, capsys):
    import subprocess
    import sys

    from bench import compare
    assert compare.client_priority("normal") == "normal"

    # Granted (root / CAP_SYS_NICE): a child started with the hook runs SCHED_FIFO.
    if compare.client_priority("realtime") == "realtime":
        policy = subprocess.run(
            [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
            preexec_fn=compare._realtime, capture_output=True, text=True, check=True).stdout
        assert int(policy) == os.SCHED_FIFO

    # Refused: the bench measures at normal priority, says so, and the rows record it.
    def refuse(*_):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(compare.os, "sched_setscheduler", refuse)
    assert compare.client_priority("realtime") == "normal"
    assert "normal priority" in capsys.readouterr().err
    rows = [_row("bare", 0, 100, 0.5) | {"client": "realtime"}, _row("gateway", 0, 90, 1.0)]
    text = summarize(rows, SimpleNamespace(backend="openai", hog=True))
    assert "load generator at normal / realtime priority" in text

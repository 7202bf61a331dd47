"""Gateway vs bare vLLM vs Ray Serve LLM: same model, same machine, same load, one run.

Each round starts every server in turn (the order rotates from round to round), drives it with
``vllm bench serve`` (random 128-in / 64-out, ignore_eos, greedy, warm-up requests excluded) at
each concurrency, and stops it, so two servers never share the CPU. Besides throughput, TTFT
and TPOT it reads the CPU time of each server's process tree and reports **CPU seconds per
1,000 output tokens outside the engine** (vLLM's EngineCore and worker processes), the figure
of a serving stack's overhead that does not depend on how fast the box's engine step is
(``cputime.py``). The engine's own column is no step cost: under load vLLM's processes poll
their queues in a busy wait, so on CPU the worker's share is its core's wall time
(docs/results/benchmarks-2026-12-07.md, "vLLM's busy wait").

Two models: the embedded SmolLM2 (the README's default), and a tiny random-weight Llama (4
layers, hidden 256, made on the fly) on which the engine is nearly free, so the serving stack's
own cost dominates. ``--hog`` runs one busy process pinned to CPU 0 beside every server
(contention). Usage::

    python bench/compare.py [--models embedded,tiny] [--targets bare,gateway,serve-llm]
                            [--concurrency 1,16,64] [--rounds 3] [--hog]

Targets: ``bare``, ``gateway`` (the README's default layout: each model its own application,
HAProxy on the public port), ``gateway-one-app`` (engines inside the gateway's application),
``gateway-serve-proxy`` (the same with Serve's proxy actor on the port), ``gateway-over-ray``
(engine replicas streaming as Ray objects: ``engine_transport: ray``), ``gateway-colocated``
(``serve_config.colocated.yaml``'s layout), ``serve-llm`` (Ray Serve LLM), and the other
variants in ``STARTERS`` (``bench/servers.py``). Results land in ``bench/results/``:
``compare.json`` (every measurement) and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from math import nan
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import cputime
from bench.load import CLIENT_PRIORITIES, client_priority, run_load
from bench.pooled import pool
from bench.servers import (
    PORTS,
    RESULTS,
    SECOND_APP,
    STARTERS,
    machine,
    models,
    serve_ready,
    start_hog,
    stop,
    stop_tree,
)


def measure(args) -> list[dict]:
    rows: list[dict] = []
    for model, model_dir, overrides in models(args.models):
        for rnd in range(args.rounds):
            order = args.targets[rnd % len(args.targets):] + args.targets[:rnd % len(args.targets)]
            for target in order:
                started = time.monotonic()
                proc = STARTERS[target](model, model_dir, overrides)
                try:
                    placed = serve_ready(target, model, proc)
                    ready_s = round(time.monotonic() - started, 1)  # start to serving
                    # What the server burns with no request at all (Ray's background, pollers):
                    # part of every per-token figure below, largest at c=1.
                    time.sleep(args.idle_s / 2)
                    before = cputime.snapshot(proc.pid)
                    time.sleep(args.idle_s)
                    idle = cputime.spent(before, cputime.snapshot(proc.pid))
                    idle = {f"idle_{k}": round(v / args.idle_s, 3) for k, v in idle.items()}
                    for conc in args.concurrency:
                        row = {"model": model, "target": target, "round": rnd,
                               "ready_s": ready_s, "peer_placement": placed, **idle,
                               **_load_row(args, proc.pid, PORTS[target], model, model_dir, conc)}
                        rows.append(row)
                        print(json.dumps({k: row[k] for k in (
                            "model", "target", "round", "ready_s", "concurrency",
                            "output_throughput", "median_ttft_ms", "median_tpot_ms",
                            "other_cpu_s", "engine_cpu_s", "total_output_tokens", "pace",
                            "steal_share", "outside_server_cpu_per_s", "cpu_s_by_process")}),
                              flush=True)
                finally:
                    stop_tree(proc, target)
    return rows


def _load_row(args, pid: int, port: int, model: str, model_dir, conc: int) -> dict:
    """One load at ``conc`` against the server whose tree is under ``pid``: the load's
    figures, the tree's CPU (engine, the rest, by process), and the box's pace and drift
    around it (``cputime.pace``, ``cputime.box_spent``)."""
    prompts = args.c1_prompts if conc == 1 else max(args.num_prompts, 2 * conc)
    pace = cputime.pace()
    before, box_before, started = cputime.snapshot(pid), cputime.box(), time.monotonic()
    result = run_load(port, model, model_dir, conc, prompts, args.backend, args.client)
    after, box_after = cputime.snapshot(pid), cputime.box()
    engines = cputime.require_engines(pid)  # a round it cannot split is refused, not counted
    cpu = cputime.spent(before, after)
    box = cputime.box_spent(box_before, box_after, cpu["engine_cpu_s"] + cpu["other_cpu_s"],
                            time.monotonic() - started)
    roles = cputime.labels(pid, apart=(SECOND_APP,))  # gateway-two-apps' idle model apart
    cpu["cpu_s_by_process"] = cputime.spent_by_role(before, after, roles)
    return {"concurrency": conc, "prompts": prompts, "client": args.client, "pace": pace,
            "engine_processes": engines,
            **box, **cpu, **{k: v for k, v in result.items() if isinstance(v, (int, float))}}


def _mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def _per_1k(rows: list[dict], key: str) -> float:
    return 1000 * sum(r[key] for r in rows) / sum(r["total_output_tokens"] for r in rows)


def summarize(rows: list[dict], args) -> str:
    lines = [f"Load: random 128-in/64-out, ignore_eos, temperature 0, backend `{args.backend}`,"
             f" {1 + max(r['round'] for r in rows)} rounds (server order rotating),"
             " warm-ups excluded"
             f"{', one busy process pinned to CPU 0 throughout' if args.hog else ''}"
             f", load generator at {_clients(rows)} priority.", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += [f"### {model}", "",
                  "| c | server | output tok/s (rounds) | mean | vs bare | TTFT p50 ms | "
                  "TPOT p50 ms | CPU s / 1k tok outside engine | engine CPU s / 1k tok | "
                  "idle CPU s/s outside engine | box pace, M turns/s (rounds) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        mine = [r for r in rows if r["model"] == model]
        for conc in sorted({r["concurrency"] for r in mine}):
            picked = {t: [r for r in mine if r["target"] == t and r["concurrency"] == conc]
                      for t in dict.fromkeys(r["target"] for r in mine)}
            bare = picked.get("bare")
            for target, got in picked.items():
                if not got:
                    continue
                tput = _mean(got, "output_throughput")
                ratio = f"{tput / _mean(bare, 'output_throughput'):.3f}x" if bare else "-"
                ttft, tpot = _mean(got, "median_ttft_ms"), _mean(got, "median_tpot_ms")
                if bare and target != "bare":
                    ttft_s = f"{ttft:.1f} ({ttft - _mean(bare, 'median_ttft_ms'):+.1f})"
                    tpot_s = f"{tpot:.2f} ({tpot - _mean(bare, 'median_tpot_ms'):+.2f})"
                else:
                    ttft_s, tpot_s = f"{ttft:.1f}", f"{tpot:.2f}"
                rounds = ", ".join(f"{r['output_throughput']:.1f}" for r in got)
                lines.append(f"| {conc} | {target} | {rounds} | {tput:.1f} | {ratio} | {ttft_s} "
                             f"| {tpot_s} | {_per_1k(got, 'other_cpu_s'):.2f} | "
                             f"{_per_1k(got, 'engine_cpu_s'):.2f} | "
                             f"{statistics.fmean(r.get('idle_other_cpu_s', nan) for r in got):.2f} | "
                             f"{_paces(got)} |")
        lines += ["", *_pooled_lines(mine), ""]
    failed = sum(r.get("failed", 0) for r in rows)
    lines.append(f"Failed requests: {failed}. Machine: {machine()}.")
    return "\n".join(lines)


def _pooled_lines(rows: list[dict]) -> list[str]:
    """Each target's throughput over bare vLLM's in the same round, one reading a round, pooled
    (``bench.pooled``: mean, standard error, 95 % interval): the figure every bar is read from."""
    bare = {(r["concurrency"], r["round"]): r["output_throughput"] for r in rows
            if r["target"] == "bare"}
    readings: dict[tuple[int, str], list[float]] = {}
    for r in rows:
        base = bare.get((r["concurrency"], r["round"]))
        if r["target"] != "bare" and base:
            readings.setdefault((r["concurrency"], r["target"]), []).append(
                r["output_throughput"] / base)
    return [f"- c={conc}, {target} vs bare, same-round ratios: {pool(got).text()}"
            for (conc, target), got in sorted(readings.items())]


def _paces(rows: list[dict]) -> str:
    # Rows from before the box's pace was read have none.
    return ", ".join(f"{r['pace']:.0f}" for r in rows if "pace" in r) or "-"


def _clients(rows: list[dict]) -> str:
    # Rows from before the option ran the load generator at normal priority.
    return " / ".join(sorted({r.get("client", "normal") for r in rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--models", type=split, default=["embedded", "tiny"])
    parser.add_argument("--targets", type=split, default=["bare", "gateway", "serve-llm"])
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="prompts per run at c > 1 (at least 2 x c)")
    parser.add_argument("--c1-prompts", type=int, default=16, help="prompts per run at c = 1")
    parser.add_argument("--backend", default="openai", choices=["openai", "openai-chat"])
    parser.add_argument("--hog", action="store_true")
    parser.add_argument("--client-priority", dest="client", choices=CLIENT_PRIORITIES,
                        default="realtime",
                        help="scheduling of the load generator (realtime: SCHED_FIFO, if allowed)")
    parser.add_argument("--idle-s", type=float, default=10,
                        help="seconds of idle CPU measured per server before its load")
    parser.add_argument("--summarize", type=Path, metavar="COMPARE_JSON",
                        help="only write the summary of an earlier run's compare.json")
    args = parser.parse_args()
    if args.summarize:
        print(summarize(json.loads(args.summarize.read_text()), args))
        return
    unknown = set(args.targets) - set(STARTERS)
    if unknown:
        raise SystemExit(f"unknown targets {sorted(unknown)}: {sorted(STARTERS)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.client = client_priority(args.client)
    hog = start_hog() if args.hog else None
    try:
        rows = measure(args)
    finally:
        if hog:
            stop(hog)
    (RESULTS / "compare.json").write_text(json.dumps(rows, indent=1))
    summary = summarize(rows, args)
    (RESULTS / "summary.md").write_text(summary + "\n")
    print("\n" + summary)


if __name__ == "__main__":
    main()

"""Where the default layout's CPU goes by process: with no request at all (the fixed cost, Ray's
and Serve's processes included), then under a short load (per streamed token).

The README's default layout (``serve_config.yaml``'s: the model its own application, the gateway
application naming it, HAProxy on the public port) on the tiny random-weight model, optionally
with the gateway's code of another checkout (``--tree``) so that two trees can be read one after
another. Results: docs/results/benchmarks-2026-12-07.md ("The idle gateway ingress", issue 32).

    python bench/background.py --idle-s 60 --prompts 256
    python bench/background.py --tree <checkout of an earlier commit> --prompts 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import cputime
from bench.load import run_load
from bench.servers import ROOT, machine, models, serve_model_apps, stop, wait_ready

PORT = 8000
SETTLE_S = 40  # after the warm-up: past the engine monitor's 30 s to its idle ticks


def _idle(pid: int, idle_s: float) -> dict:
    """CPU-seconds per second by process, and outside the engine, over ``idle_s`` with no
    request; and the main thread of each Ray worker (Ray's signal check, ``main_threads``)."""
    roles = cputime.labels(pid)
    ray_workers = [p for p, role in roles.items() if role.startswith("ray::")]
    before, mains = cputime.snapshot(pid), cputime.main_threads(ray_workers)
    time.sleep(idle_s)
    after, mains_after = cputime.snapshot(pid), cputime.main_threads(ray_workers)
    spent = cputime.spent_by_role(before, after, roles)
    return {"idle_outside_engine": round(cputime.spent(before, after)["other_cpu_s"] / idle_s, 4),
            "idle_cpu_s_per_s": {role: round(cpu / idle_s, 4)
                                 for role, cpu in spent.items() if cpu > 0.005},
            "idle_ray_main_threads": {
                f"{roles[p]} ({p})": {"cpu_s_per_s": round((cpu - mains[p][0]) / idle_s, 4),
                           "wakeups_per_s": round((woken - mains[p][1]) / idle_s, 1)}
                for p, (cpu, woken) in mains_after.items() if p in mains}}


def _loaded(pid: int, model: str, model_dir: str, prompts: int) -> dict:
    """CPU-ms per streamed token by process under ``prompts`` requests at c=16."""
    before = cputime.snapshot(pid)
    result = run_load(PORT, model, model_dir, 16, prompts, "openai", "realtime")
    after = cputime.snapshot(pid)
    spent = cputime.spent_by_role(before, after, cputime.labels(pid))
    tokens = result["total_output_tokens"]
    outside = cputime.spent(before, after)["other_cpu_s"]
    return {"tok_s": round(result["output_throughput"], 1),
            "outside_engine_s_per_1k_tok": round(1000 * outside / tokens, 3),
            "ms_per_token": {role: round(1000 * cpu / tokens, 4)
                             for role, cpu in spent.items() if cpu > 0.01}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the gateway's checkout")
    parser.add_argument("--idle-s", type=float, default=60)
    parser.add_argument("--prompts", type=int, default=256, help="0: the idle reading only")
    args = parser.parse_args()
    model, model_dir, overrides = models(["tiny"])[0]
    proc = serve_model_apps(model, model_dir, overrides, root=args.tree)
    try:
        wait_ready(f"http://127.0.0.1:{PORT}", model, proc)
        run_load(PORT, model, model_dir, 16, 32, "openai", "realtime")  # warm-up
        time.sleep(SETTLE_S)
        report = {"machine": machine(), "tree": str(args.tree), **_idle(proc.pid, args.idle_s)}
        if args.prompts:
            report["load_c16"] = _loaded(proc.pid, model, model_dir, args.prompts)
        print(json.dumps(report, indent=1))
    finally:
        stop(proc)


if __name__ == "__main__":
    main()

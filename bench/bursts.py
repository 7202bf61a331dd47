"""Ten bursts of 2,000 concurrent plain completions: how fast refusals and ``/health`` answer,
and the memory of the serving processes after each burst (a leak grows burst after burst, an
allocator's high-water mark levels off). The engine batches 4 sequences, so most of each burst
is refused (the overload scenario of ``bench/reliability.py``, repeated).

    python bench/bursts.py [--bursts 10] [--requests 2000] [--out bench/results/bursts.json]
                           [--plot docs/results/bursts-memory.png]

Figures and the plot: docs/reliability.md ("Bursts and memory").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.load import CLIENT_PRIORITIES, realtime_client  # noqa: E402
from bench.reliability import box  # noqa: E402
from bench.reliability_clients import MODEL, OVERLOAD_ENGINE_ARGS, PROMPTS  # noqa: E402
from bench.reliability_gateway import (  # noqa: E402
    Gateway,
    _mb,
    _replica_processes,
    engine_processes,
)
from bench.reliability_load import _burst  # noqa: E402
from gateway.edge.proxy import MAX_REQUESTS_VAR  # noqa: E402

SETTLE_S = 5.0  # after a burst, before memory is read


def memory_mb() -> dict[str, float]:
    """RSS per serving process: Serve's proxy, the ingress replica, the engine replica and
    vLLM's processes under it (EngineCore, worker)."""
    groups: dict[str, list[psutil.Process]] = {
        "proxy": _replica_processes("", "ray::ProxyActor"),
        "ingress": _replica_processes("GatewayIngress"),
    }
    engine = engine_processes()
    groups["engine replica"] = engine[:1]
    for proc in engine[1:]:
        with contextlib.suppress(psutil.Error):
            name = "reaper" if proc.name().startswith("python") else proc.name()
            groups.setdefault(name, []).append(proc)
    out = {}
    for name, procs in groups.items():
        total = 0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        out[name] = _mb(total)
    return out


def run(url: str, bursts: int, requests: int) -> list[dict[str, Any]]:
    plain = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
    rows = [{"burst": 0, "memory_mb": memory_mb()}]
    for index in range(1, bursts + 1):
        figures = asyncio.run(_burst(url, requests, plain, False))
        time.sleep(SETTLE_S)
        row = {"burst": index, "memory_mb": memory_mb(),
               **{k: figures[k] for k in ("seconds", "statuses", "refusal_p50_s",
                                          "refusal_p95_s", "refusal_max_s", "health_during",
                                          "refusals_not_in_shape", "5xx_other_than_503",
                                          "cpu_s_during")}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def growth(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean growth per burst after the first, in % of the size after the first burst."""
    first, last = rows[1]["memory_mb"], rows[-1]["memory_mb"]
    bursts = len(rows) - 2
    return {name: round(100 * (last[name] - first[name]) / first[name] / bursts, 2)
            for name in first if name in last and first[name] and bursts > 0}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows[0]["memory_mb"])  # ("python": the reaper, in rows of earlier runs)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        ax.plot([r["burst"] for r in rows], [r["memory_mb"].get(name) for r in rows],
                marker="o", label=name)
    ax.set_xlabel("after burst (0: before the first)")
    ax.set_ylabel("RSS (MB)")
    ax.set_yscale("log")
    ax.set_title("RSS of the serving processes, bursts of concurrent completions")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bursts.json")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--client-priority", choices=CLIENT_PRIORITIES, default="realtime",
                        help="the burst client's scheduling (default real-time: on a 2-core box "
                             "a client at normal priority measures its own waits for a core)")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    gw = Gateway()
    try:
        gw.start()
        gw.deploy(OVERLOAD_ENGINE_ARGS)
        client = realtime_client(args.client_priority)  # after the start: servers stay normal
        report = {"box": box(), "engine_args": OVERLOAD_ENGINE_ARGS, "requests": args.requests,
                  "client": client, "proxy_max_requests": os.environ.get(MAX_REQUESTS_VAR),
                  "rows": run(gw.url, args.bursts, args.requests)}
    finally:
        gw.stop()
    report["growth_pct_per_burst_after_the_first"] = growth(report["rows"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report["growth_pct_per_burst_after_the_first"]))
    if args.plot:
        plot(report["rows"], args.plot)


if __name__ == "__main__":
    main()

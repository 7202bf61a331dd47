"""LoRA adapters' cost: output throughput and TTFT with 8 adapters in rotation against the base
model alone, on one gateway (the default layout, the tiny model with ``lora`` on), the two loads
alternated in one run (docs/results/benchmarks-2026-12-07.md, "LoRA adapters").

    python bench/adapters.py [--adapters 8] [--max-loaded 4] [--passes 4] [--concurrency 16]
                             [--num-prompts 256]

Loads, by ``vllm bench serve`` (random 128-token prompts, 64 tokens out, ``--ignore-eos``): ``base``
names the model; ``rotation`` names the adapters round-robin (``--lora-modules``), so a replica
holding ``--max-loaded`` of them swaps the rest in and out. Passes run base, rotation, rotation,
base, ... (ABBA, so a drift of the box over the run weighs on both alike); each pair's ratio is
one reading, pooled (``bench.pooled``). Writes ``bench/results/adapters-<time>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import servers
from bench.load import CLIENT_PRIORITIES, client_priority, run_load
from bench.pooled import pool
from tests.lora_adapters import save_random_adapter

LOADS = ("base", "rotation")
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def build(count: int) -> tuple[Path, Path]:
    """The tiny model and a directory of ``count`` random rank-8 adapters on it."""
    root = Path(tempfile.mkdtemp(prefix="adapters-"))
    embedded = servers.prepare_embedded_model()
    model_dir = servers.build_tiny(root / "tiny", Path(embedded))
    for i in range(count):
        save_random_adapter(model_dir, root / "adapters" / f"a{i}", seed=i)
    return model_dir, root / "adapters"


def measure(args) -> list[dict]:
    model_dir, directory = build(args.adapters)
    names = [f"a{i}" for i in range(args.adapters)]
    lora = {"directory": str(directory), "max_loaded": args.max_loaded}
    proc = servers.serve_model_apps(servers.TINY_NAME, str(model_dir), servers.TINY_OVERRIDES,
                                    options={"lora": lora})
    rows = []
    try:
        servers.serve_ready("gateway", servers.TINY_NAME, proc)
        order = [LOADS[(p // 2 + p) % 2] for p in range(2 * args.passes)]  # ABBA...
        for index, load in enumerate(order):
            extra = ("--lora-modules", *names, "--lora-assignment", "round-robin") \
                if load == "rotation" else ()
            result = run_load(servers.PORTS["gateway"], servers.TINY_NAME, str(model_dir),
                              args.concurrency, args.num_prompts, "openai", args.client, extra)
            row = {"pass": index, "load": load, "failed": result.get("failed"),
                   **{m: round(result[m], 2) for m in METRICS}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        servers.stop_tree(proc, "gateway")
    return rows


def readings(rows: list[dict], metric: str) -> list[float]:
    """Rotation over base, per pair of passes (passes 2k and 2k+1 hold one of each)."""
    out = []
    for first, second in zip(rows[::2], rows[1::2], strict=False):
        by_load = {first["load"]: first[metric], second["load"]: second[metric]}
        if set(by_load) == set(LOADS) and by_load["base"]:
            out.append(by_load["rotation"] / by_load["base"])
    return out


def report(rows: list[dict], args) -> str:
    lines = [f"{args.adapters} adapters (rank 8), {args.max_loaded} loaded per replica at most, "
             f"one replica; {args.num_prompts} requests a pass at concurrency {args.concurrency}, "
             f"{args.passes} passes of each load; {servers.machine()}; load generator at "
             f"{args.client} priority.", "",
             "| pass | load | output tok/s | TTFT p50 ms | TPOT p50 ms | failed |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['pass']} | {r['load']} | {r['output_throughput']} | {r['median_ttft_ms']} | "
              f"{r['median_tpot_ms']} | {r['failed']} |" for r in rows]
    lines += ["", "Rotation against base (each pair of passes one reading, pooled):"]
    lines += [f"- {metric}: {pool(readings(rows, metric)).text()}" for metric in METRICS]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--max-loaded", type=int, default=4)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--client", choices=CLIENT_PRIORITIES, default="realtime")
    args = parser.parse_args()
    args.client = client_priority(args.client)
    rows = measure(args)
    servers.write_results("adapters", args, rows, report(rows, args))


if __name__ == "__main__":
    main()

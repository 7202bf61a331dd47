"""Tiers under load: a better tier's TTFT alone and under a flood of a worse tier, and an
interactive key's TTFT idle and while a batch runs (docs/results/benchmarks-2026-12-07.md, "Tenants").

    python bench/tenancy.py [--rounds 3] [--gates 16/4,8/4,off] [--flood 64] [--batch-lines 256]

The default layout (the tiny model its own application, the gateway application, HAProxy) with
keys ``gold`` (tier 0), ``bulk`` (tier 5) and ``free`` (tier 1), once per ``--gates`` entry:
``max_running/headroom`` of the model's priority gate, or ``off`` (vLLM's priority queue only).
Each round measures, in this order: ``alone`` (gold: 4 streams, each 6 requests in turn, TTFT of
each), ``flood`` (the same while ``--flood`` bulk clients loop on 64-token requests),
``idle`` (free, as gold alone) and ``batch`` (free while a batch of ``--batch-lines`` chat lines
runs). A round's flood/alone and batch/idle ratios of TTFT p50 are one reading each, pooled
(``bench.pooled``), with the flood's own output; a first round warms the server up and is
listed, not pooled. Writes ``bench/results/tenancy-<time>.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import servers
from bench.load import CLIENT_PRIORITIES, realtime_client
from bench.pooled import pool
from gateway.model_routes import model_route

KEYS = [{"key": "gold-key", "name": "gold", "tier": 0},
        {"key": "bulk-key", "name": "bulk", "tier": 5},
        {"key": "free-key", "name": "free"}]
LOADS = ("alone", "flood", "idle", "batch")


def start(model_dir: str, gate: str, state: Path):
    scheduling = {} if gate == "off" else dict(zip(("max_running", "headroom"),
                                                    map(int, gate.split("/")), strict=True))
    model = {"name": servers.TINY_NAME, "source": model_dir,
             "engine_args": servers.TINY_OVERRIDES, "scheduling": scheduling}
    settings = {"api_keys": KEYS, "state_directory": str(state)}
    apps = [{"name": "model-0", "route_prefix": model_route(servers.TINY_NAME),
             "import_path": "gateway.app:build_model_app",
             "args": {"model": model, "gateway": settings}},
            {"name": "gateway", "route_prefix": "/", "import_path": "gateway.app:build_app",
             "args": {"models": [{**model, "app": "model-0"}], **settings}}]
    return servers.serve_run(servers.PORTS["gateway"], apps, servers._ray_env())


async def ttft_s(c: httpx.AsyncClient, key: str, prompt: str) -> float:
    started = time.perf_counter()
    async with c.stream("POST", "/v1/completions", headers={"authorization": f"Bearer {key}"},
                        json={"model": servers.TINY_NAME, "prompt": prompt, "max_tokens": 16,
                              "temperature": 0, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - started
    raise RuntimeError(f"no token ({response.status_code})")


async def streams(c: httpx.AsyncClient, key: str) -> list[float]:
    """4 streams, each 6 requests one after another: every request's TTFT."""
    async def one(s: int) -> list[float]:
        return [await ttft_s(c, key, f"Stream {s} request {i}: the weather") for i in range(6)]
    return [t for ts in await asyncio.gather(*(one(s) for s in range(4))) for t in ts]


async def flooded(c: httpx.AsyncClient, clients: int) -> tuple[list[float], float]:
    """Gold's TTFTs under the flood, and the flood's own output (tokens/s) from its start to
    the end of gold's streams (its requests finish in waves: a shorter window reads 0)."""
    stop, finished = asyncio.Event(), []

    async def loop(i: int) -> None:
        while not stop.is_set():
            r = await c.post("/v1/completions", headers={"authorization": "Bearer bulk-key"},
                             json={"model": servers.TINY_NAME, "prompt": f"Flood {i}",
                                   "max_tokens": 64, "ignore_eos": True})
            if r.status_code == 200:
                finished.append(time.perf_counter())

    started = time.perf_counter()
    tasks = [asyncio.create_task(loop(i)) for i in range(clients)]
    await asyncio.sleep(3.0)
    try:
        readings = await streams(c, "gold-key")
        ended = time.perf_counter()
        return readings, 64 * sum(t <= ended for t in finished) / (ended - started)
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def batched(c: httpx.AsyncClient, lines: int) -> list[float]:
    content = "".join(json.dumps({
        "custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": servers.TINY_NAME, "max_tokens": 64, "ignore_eos": True,
                 "messages": [{"role": "user", "content": f"Line {i}"}]}}) + "\n"
        for i in range(lines))
    auth = {"authorization": "Bearer free-key"}
    uploaded = (await c.post("/v1/files", headers=auth, data={"purpose": "batch"},
                             files={"file": ("b.jsonl", content.encode())})).json()
    batch = (await c.post("/v1/batches", headers=auth, json={
        "input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})).json()
    await asyncio.sleep(3.0)
    readings = await streams(c, "free-key")
    await c.post(f"/v1/batches/{batch['id']}/cancel", headers=auth)
    while (await c.get(f"/v1/batches/{batch['id']}", headers=auth)).json()["status"] not in (
            "cancelled", "completed"):
        await asyncio.sleep(0.5)
    return readings


async def round_of(flood: int, lines: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{servers.PORTS['gateway']}",
                                 timeout=300, limits=httpx.Limits(max_connections=256)) as c:
        alone = await streams(c, "gold-key")
        flood_ttfts, flood_tokens_s = await flooded(c, flood)
        out = {"alone": alone, "flood": flood_ttfts, "idle": await streams(c, "free-key"),
               "batch": await batched(c, lines)}
    return {**{load: round(statistics.median(v) * 1000, 2) for load, v in out.items()},
            "flood_tokens_s": round(flood_tokens_s, 1)}


def measure(args) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="tenancy-"))
    model_dir = str(servers.build_tiny(root / "tiny", Path(servers.prepare_embedded_model())))
    rows = []
    for gate in args.gates.split(","):
        proc = start(model_dir, gate, root / f"state-{gate.replace('/', '-')}")
        try:
            servers.wait_ready(f"http://127.0.0.1:{servers.PORTS['gateway']}", servers.TINY_NAME,
                               proc, headers={"authorization": "Bearer free-key"})
            # Round -1 warms the server up (its first requests ran 5x slower): listed, not pooled.
            for index in range(-1, args.rounds):
                row = {"gate": gate, "round": index,
                       **asyncio.run(round_of(args.flood, args.batch_lines))}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            servers.stop_tree(proc, "gateway")
    return rows


def report(rows: list[dict], args) -> str:
    lines = [f"Tiny model, one replica, default layout; gold (tier 0) and free (tier 1): 4 "
             f"streams x 6 requests of 16 tokens; flood: {args.flood} bulk (tier 5) clients of "
             f"64 tokens; batch: {args.batch_lines} lines of 64 tokens (tier 9, 8 at a time); "
             f"{args.rounds} rounds per gate; {servers.machine()}; load generator at "
             f"{args.client} priority.", "",
             "| gate | round | alone TTFT p50 ms | flood | idle | batch | flood tok/s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['gate']} | {'warm-up' if r['round'] < 0 else r['round']} | {r['alone']} | "
              f"{r['flood']} | {r['idle']} | {r['batch']} | {r.get('flood_tokens_s')} |"
              for r in rows]
    lines += ["", "TTFT p50 ratios (each round one reading, pooled; the warm-up round not):"]
    for gate in args.gates.split(","):
        mine = [r for r in rows if r["gate"] == gate and r["round"] >= 0]
        for under, base in (("flood", "alone"), ("batch", "idle")):
            readings = [r[under] / r[base] for r in mine if r[base]]
            lines.append(f"- gate {gate}, {under} / {base}: {pool(readings).text()}")
        lines.append(f"- gate {gate}, the flood's output: "
                     f"{pool([r['flood_tokens_s'] for r in mine]).text(' tok/s')}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gates", default="16/4,8/4,off")
    parser.add_argument("--flood", type=int, default=64)
    parser.add_argument("--batch-lines", type=int, default=256)
    parser.add_argument("--client", choices=CLIENT_PRIORITIES, default="realtime")
    args = parser.parse_args()
    args.client = realtime_client(args.client)
    rows = measure(args)
    servers.write_results("tenancy", args, rows, report(rows, args))


if __name__ == "__main__":
    main()

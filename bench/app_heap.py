"""The gateway app alone (no Ray, the fake engine) under uvicorn, bursts of concurrent plain
completions: the Python heap (``tracemalloc``) and the process's RSS after each burst, and the
lines whose allocations grew most between the second burst and the last. A leak in the gateway's
code shows as a growing heap; the C allocator's high-water mark as RSS without it
(docs/reliability.md, "Bursts and memory").

    python bench/app_heap.py [--bursts 10] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import aiohttp
import psutil
import uvicorn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.config import GatewayConfig  # noqa: E402
from gateway.ingress.asgi import create_app  # noqa: E402
from gateway.ingress.registry import ModelRegistry  # noqa: E402
from gateway.serve_env import free_port  # noqa: E402
from tests.fake_engine import FakeEngine  # noqa: E402


class _Forget(list):
    """The fake engine lists every request for the tests; here that would be the leak."""

    def append(self, _item) -> None:
        return None


async def burst(port: int, n: int) -> dict[int, int]:
    connector = aiohttp.TCPConnector(limit=n + 8)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector) as s:
        async def one() -> int:
            body = {"model": "fake-model", "prompt": "Hi", "max_tokens": 8}
            async with s.post("/v1/completions", json=body) as r:
                await r.read()
                return r.status
        statuses = await asyncio.gather(*(one() for _ in range(n)))
    return {s: statuses.count(s) for s in sorted(set(statuses))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    tracemalloc.start(10)
    engine = FakeEngine(delay=0.001)
    engine.requests = _Forget()
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", backlog=4096))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    baseline = None
    for index in range(1, args.bursts + 1):
        statuses = asyncio.run(burst(port, args.requests))
        gc.collect()
        time.sleep(1)
        heap = tracemalloc.get_traced_memory()[0] / 2**20
        rss = psutil.Process().memory_info().rss / 2**20
        print(f"burst {index}: {statuses}  heap {heap:.1f} MB  RSS {rss:.1f} MB", flush=True)
        if index == 2:
            baseline = tracemalloc.take_snapshot()
    if baseline is not None:
        for stat in tracemalloc.take_snapshot().compare_to(baseline, "lineno")[:10]:
            print(stat)
    server.should_exit = True


if __name__ == "__main__":
    main()

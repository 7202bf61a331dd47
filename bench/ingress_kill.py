"""What clients see when the ingress replica is killed (``kill -9``): streams in flight, and
requests sent on four protocols while it is gone (docs/reliability.md, "The ingress replica
itself dying"). A tiny random Llama on the pipeline kind, so the engine costs nothing.

    python bench/ingress_kill.py [--ingress-replicas 1] [--requests 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.kit.config import ModelConfig  # noqa: E402
from engines.kit.embedded import local_model_dir, prepare_embedded_model  # noqa: E402
from gateway import serve_env  # noqa: E402
from gateway.app import build_app  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.serve_env import free_port  # noqa: E402
from tests.pipeline_models import build_tiny  # noqa: E402
from tests.serve_session import _wait_healthy  # noqa: E402

PATHS = [("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2}),
         ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
         ("/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
         ("/v2/models/tiny/generate", {"text_input": "Hi", "parameters": {"max_new_tokens": 2}})]


def ingress_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "ServeReplica:gateway:GatewayIngress" in " ".join(p.info["cmdline"] or [])]


async def stream(c: httpx.AsyncClient, killed: list[float]) -> str:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    try:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass
        outcome = f"ended {r.status_code}"
    except httpx.HTTPError as exc:
        outcome = f"cut ({type(exc).__name__})"
    return f"{outcome} {time.monotonic() - killed[0]:.2f} s after the kill" if killed else outcome


async def waiting(c: httpx.AsyncClient, killed: list[float]) -> str:
    """A non-streaming request in flight: nothing of its answer was sent when the ingress died."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
    try:
        r = await c.post("/v1/completions", json=body)
        shaped = r.headers.get("content-type", "").startswith("application/json")
        outcome = f"{r.status_code}, retry-after {r.headers.get('retry-after')}, JSON {shaped}"
    except httpx.HTTPError as exc:
        outcome = f"no answer ({type(exc).__name__})"
    return f"{outcome} {time.monotonic() - killed[0]:.2f} s after the kill" if killed else outcome


async def one(c: httpx.AsyncClient, index: int) -> str:
    path, body = PATHS[index % len(PATHS)]
    started = time.monotonic()
    r = await c.post(path, json=body)
    shaped = r.headers.get("content-type", "").startswith("application/json")
    return (f"{path}: {r.status_code} in {time.monotonic() - started:.3f} s, retry-after "
            f"{r.headers.get('retry-after')}, JSON {shaped}")


async def measure(url: str, requests: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        killed: list[float] = []
        streams = [asyncio.create_task(stream(c, killed)) for _ in range(3)]
        waits = [asyncio.create_task(waiting(c, killed)) for _ in range(3)]
        await asyncio.sleep(3)
        victim = ingress_pids()[0]
        os.kill(victim, signal.SIGKILL)
        killed.append(time.monotonic())
        tasks = []
        for index in range(requests):
            tasks.append(asyncio.create_task(one(c, index)))
            await asyncio.sleep(0.1)
        for line in await asyncio.gather(*tasks):
            print(line)
        for line in await asyncio.gather(*streams):
            print("stream in flight:", line)
        for line in await asyncio.gather(*waits):
            print("non-streaming request in flight:", line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ingress-replicas", type=int, default=1)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    import ray
    from ray import serve

    serve_env.apply()
    prepare_embedded_model()
    tokenizer = Path(local_model_dir("embedded:smollm2-135m-instruct") or "")
    tiny = build_tiny("llama", Path(tempfile.mkdtemp()) / "tiny", tokenizer)
    port = free_port()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        model = ModelConfig(name="tiny", engine="pipeline", source=str(tiny), num_cpus=0.05,
                            engine_args={"num_stages": 1, "stage_num_cpus": 0.05,
                                         "max_sequences": 8})
        config = GatewayConfig(models=[model], ingress_num_cpus=0.05,
                               ingress_replicas=args.ingress_replicas)
        serve.run(build_app(config), name="gateway", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, "the gateway")
        asyncio.run(measure(url, args.requests))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

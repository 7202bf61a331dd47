"""The CPU the gateway's own code spends per request and per streamed token: the app over the
fake engine, driven by raw ASGI calls (no HTTP server, no Ray, no vLLM), so that what is left is
the protocol layer, the middlewares, the engine host and the SSE framing
(docs/results/benchmarks-2026-12-07.md, "The replica's own cost per token, on an AVX2 box").

Streamed OpenAI completions, ``--concurrency`` at a time; one run with ``--tokens`` a request
and one with 2, so the per-request part and the per-token part come apart:

    python bench/app_path.py [--requests 400] [--tokens 64] [--concurrency 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.config import GatewayConfig  # noqa: E402
from gateway.ingress.asgi import create_app  # noqa: E402
from gateway.ingress.bounds import BoundedEngine  # noqa: E402
from gateway.ingress.local_engine import LocalEngineClient  # noqa: E402
from gateway.ingress.registry import ModelRegistry  # noqa: E402
from tests import fake_engine  # noqa: E402

_PATH = "/v1/completions"


def _scope() -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": _PATH, "raw_path": _PATH.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"),
                                         (b"host", b"bench")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}


async def _call(app, body: bytes) -> int:
    """One streamed request; returns the body chunks the app sent."""
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    chunks = 0

    async def send(message: dict) -> None:
        nonlocal chunks
        chunks += message["type"] == "http.response.body"

    await app(_scope(), receive, send)
    return chunks


async def measure(requests: int, tokens: int, concurrency: int) -> float:
    """CPU seconds of this process per request, after a warm-up."""
    fake_engine.MAX_MODEL_LEN = max(fake_engine.MAX_MODEL_LEN, tokens + 16)
    # As a model's own replica builds it (gateway/model_replica/ingress.py).
    client = BoundedEngine(LocalEngineClient(fake_engine.FakeEngine(reply="abcdefgh"),
                                             "fake-model"), "fake-model", max_pending=1024,
                           request_timeout_s=600.0)
    app = create_app(ModelRegistry({"fake-model": client}), GatewayConfig())
    body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": tokens,
                       "stream": True, "ignore_eos": True, "temperature": 0}).encode()
    slots = asyncio.Semaphore(concurrency)

    async def one() -> int:
        async with slots:
            return await _call(app, body)

    await asyncio.gather(*(one() for _ in range(3 * concurrency)))
    gc.collect()
    started = time.process_time()
    chunks = await asyncio.gather(*(one() for _ in range(requests)))
    spent = time.process_time() - started
    if min(chunks) < tokens:
        raise SystemExit(f"a request streamed {min(chunks)} chunks for {tokens} tokens")
    return spent / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.rounds):
        long = asyncio.run(measure(args.requests, args.tokens, args.concurrency))
        short = asyncio.run(measure(args.requests, 2, args.concurrency))
        per_token = (long - short) / (args.tokens - 2)
        print(f"{1e6 * long / args.tokens:6.1f} us a token at {args.tokens} tokens a request; "
              f"per request {1e6 * (short - 2 * per_token):6.0f} us, per token "
              f"{1e6 * per_token:5.1f} us")


if __name__ == "__main__":
    main()

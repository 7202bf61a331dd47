"""Protocol paths on the same engine, same run: LMTP, MindIE, LMI, TGI, OpenAI chat, OpenAI
Responses and Anthropic's Messages vs the OpenAI completions path (and the chat-shaped paths
against OpenAI chat).

All drive the same kind of greedy work at the same concurrency against one gateway, alternating
rounds to cancel drift: prompts are random token ids turned into text and back, so the token
paths (OpenAI, LMTP) send exactly the ids the engine derives from the text the others send; 64 new
tokens each. Each run gets fresh prompts so none of them is served from the prefix cache::

    python bench/protocols.py --url http://127.0.0.1:8000 [--num-prompts 64] [--concurrency 16]

Without ``--url`` it starts the gateway itself (``serve run``; ``--layout fast`` for the
colocated engine behind HAProxy) and stops it afterwards, and then also reports the gateway's CPU
seconds per 1,000 tokens outside vLLM's engine processes for each path (``cputime.py``), the
figure that does not depend on the box. Each round runs the paths in another order (rotated), so
none always runs first or last. The clients run in this process, at real-time priority where the
OS allows it (``--client-priority``, as ``compare.py``'s load generator): on a small box a client
waiting for a core would otherwise be counted as its path's cost; their own CPU per 1,000 tokens
is reported too. Throughput counts generated tokens as each protocol reports them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import websockets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cputime  # noqa: E402
from bench.load import CLIENT_PRIORITIES, realtime_client  # noqa: E402
from bench.servers import (  # noqa: E402
    PORTS,
    RESULTS,
    STARTERS,
    machine,
    stop,
    venv_bin,
    wait_ready,
)
from engines.kit.embedded import EMBEDDED_MODEL_NAME as MODEL  # noqa: E402
from engines.kit.embedded import prepare_embedded_model  # noqa: E402

# The gateway layouts this can start: the default (Serve's proxy on the public port, engine
# replica behind the ingress) and the fast one (engine inside the ingress replica, HAProxy on
# the public port: LLM_GATEWAY_INGRESS=haproxy with serve_config.colocated.yaml).
LAYOUTS = {"default": "gateway", "fast": "gateway-colocated-haproxy"}

Runner = Callable[[dict, int], Awaitable[tuple[int, float]]]  # → (tokens, ttft seconds)


def _prompts(url: str, n: int, length: int, seed: int = 0) -> list[dict]:
    """``{"text", "ids"}`` pairs where ``ids`` is exactly how the engine tokenizes ``text``."""
    rng = random.Random(seed)
    out = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(n):
            ids = [rng.randrange(100, 40000) for _ in range(length)]
            text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
            ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
            out.append({"text": text, "ids": ids})
    return out


async def _openai_one(client: httpx.AsyncClient, prompt: dict, max_tokens: int):
    body = {"model": MODEL, "prompt": prompt["ids"], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - started
            if chunk.get("usage") and not chunk.get("choices"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, ttft or 0.0


async def _stream_lines(client: httpx.AsyncClient, path: str, body: dict, prefix: str,
                        tokens_of: Callable[[dict], int | None]):
    """POST a streamed request; TTFT at the first event, tokens as the last event reports."""
    started, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line or not line.startswith(prefix) or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            count = tokens_of(json.loads(line[len(prefix):]))
            tokens = count if count is not None else tokens
    return tokens, ttft or 0.0


def _generated_tokens(event: dict) -> int | None:
    return (event.get("details") or {}).get("generated_tokens")


async def _chat_one(client: httpx.AsyncClient, prompt: dict, max_tokens: int):
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt["text"]}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    return await _stream_lines(client, "/v1/chat/completions", body, "data: ",
                               lambda chunk: (chunk.get("usage") or {}).get("completion_tokens"))


async def _anthropic_one(client: httpx.AsyncClient, prompt: dict, max_tokens: int):
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt["text"]}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    return await _stream_lines(client, "/v1/messages", body, "data: ",
                               lambda event: (event.get("usage") or {}).get("output_tokens"))


async def _responses_one(client: httpx.AsyncClient, prompt: dict, max_tokens: int):
    body = {"model": MODEL, "input": prompt["text"], "max_output_tokens": max_tokens,
            "temperature": 0, "stream": True}
    return await _stream_lines(client, "/v1/responses", body, "data: ",
                               lambda event: ((event.get("response") or {}).get("usage")
                                              or {}).get("output_tokens"))


async def _mindie_one(client: httpx.AsyncClient, prompt: dict, max_tokens: int):
    body = {"text_input": prompt["text"],
            "parameters": {"do_sample": False, "max_new_tokens": max_tokens, "details": True}}
    return await _stream_lines(client, f"/v2/models/{MODEL}/generate_stream", body, "data:",
                               _generated_tokens)


async def _lmi_one(client: httpx.AsyncClient, prompt: dict, max_tokens: int):
    """LMI rolling batch, JSON lines (the SageMaker default stream)."""
    body = {"inputs": prompt["text"], "stream": True,
            "parameters": {"do_sample": False, "max_new_tokens": max_tokens, "details": True}}
    return await _stream_lines(client, f"/predictions/{MODEL}", body, "", _generated_tokens)


async def _tgi_one(client: httpx.AsyncClient, prompt: dict, max_tokens: int):
    body = {"inputs": prompt["text"], "parameters": {"max_new_tokens": max_tokens,
                                                     "details": True}}
    return await _stream_lines(client, "/generate_stream", body, "data:", _generated_tokens)


class _LMTPConnection:
    """One websocket, requests sent one after another (like one LMQL query at a time)."""

    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0

    async def run(self, prompt: dict, max_tokens: int):
        self.next_id += 1
        sid = self.next_id
        started, ttft, tokens = time.perf_counter(), None, 0
        payload = {"model": MODEL, "prompt": prompt["ids"], "stream_id": sid, "max_tokens": max_tokens,
                   "temperature": 0.0}
        await self.ws.send(f"GENERATE {json.dumps(payload)}")
        while True:
            _, _, body = (await self.ws.recv()).partition(" ")
            for item in json.loads(body):
                if item.get("error"):
                    raise RuntimeError(item["error"])
                if ttft is None:
                    ttft = time.perf_counter() - started
                tokens += 1
                if item.get("finish_reason"):
                    return tokens, ttft


async def _drive(name: str, prompts, concurrency: int, max_tokens: int, make_runner,
                 server_pid: int | None = None) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[tuple[int, float]] = []

    async def worker():
        async with make_runner() as run:
            while not queue.empty():
                results.append(await run(queue.get_nowait(), max_tokens))

    server = cputime.snapshot(server_pid) if server_pid else {}
    client, started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    duration = time.perf_counter() - started
    client = time.process_time() - client
    tokens = sum(t for t, _ in results)
    row = {"protocol": name, "tokens": tokens, "seconds": duration,
           "tok_per_s": tokens / duration,
           "median_ttft_ms": statistics.median(f for _, f in results) * 1000,
           "client_cpu_s": round(client, 3)}
    if server_pid:
        row.update(cputime.spent(server, cputime.snapshot(server_pid)))
    return row


def rotated(paths: list[str], round_no: int) -> list[str]:
    """Round 1 runs the paths as given, round 2 starts at the second, and so on."""
    k = (round_no - 1) % len(paths)
    return paths[k:] + paths[:k]



def _http_runner(url: str, one):
    class Ctx:
        async def __aenter__(self):
            self.client = httpx.AsyncClient(base_url=url, timeout=600)
            return lambda p, m: one(self.client, p, m)

        async def __aexit__(self, *exc):
            await self.client.aclose()

    return Ctx()


def _lmtp_runner(url: str):
    class Ctx:
        async def __aenter__(self):
            self.ws = await websockets.connect(url.replace("http://", "ws://") + "/",
                                               max_size=2**24)
            return _LMTPConnection(self.ws).run

        async def __aexit__(self, *exc):
            await self.ws.close()

    return Ctx()


PATHS = {
    "openai": lambda url: _http_runner(url, _openai_one),
    "lmtp": _lmtp_runner,
    "mindie": lambda url: _http_runner(url, _mindie_one),
    "lmi": lambda url: _http_runner(url, _lmi_one),
    "tgi": lambda url: _http_runner(url, _tgi_one),
    "openai-chat": lambda url: _http_runner(url, _chat_one),
    "anthropic": lambda url: _http_runner(url, _anthropic_one),
    "responses": lambda url: _http_runner(url, _responses_one),
}


async def measure(url: str, args, server_pid: int | None = None) -> list[dict]:
    # Every (round, path) gets its own prompts (same lengths, another seed): reusing prompts
    # would let later runs hit vLLM's prefix cache and skip their prefills.
    seeds = iter(range(1000))
    paths = {name: PATHS[name] for name in args.paths}
    for make in paths.values():  # warm every path
        warm = _prompts(url, 4, 128, seed=next(seeds))
        await _drive("warmup", warm, 4, 8, lambda make=make: make(url))
    rows = []
    for round_no in range(1, args.rounds + 1):
        for name in rotated(list(paths), round_no):
            make = paths[name]
            prompts = _prompts(url, args.num_prompts, 128, seed=next(seeds))
            row = await _drive(name, prompts, args.concurrency, 64, lambda make=make: make(url),
                               server_pid)
            row = {"round": round_no, "client": args.client, **row}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def summarize(rows: list[dict], args) -> str:
    def mean(name, key):
        return statistics.mean(r[key] for r in rows if r["protocol"] == name)

    def per_1k(name, key):
        got = [r for r in rows if r["protocol"] == name and key in r]
        return 1000 * sum(r[key] for r in got) / sum(r["tokens"] for r in got) if got else None

    labels = {"openai": "OpenAI `/v1/completions` (SSE)", "lmtp": "LMTP websocket",
              "mindie": "MindIE `generate_stream` (SSE)",
              "lmi": "LMI `/predictions` (JSON lines)", "tgi": "TGI `/generate_stream` (SSE)",
              "openai-chat": "OpenAI `/v1/chat/completions` (SSE)",
              "anthropic": "Anthropic `/v1/messages` (SSE)",
              "responses": "OpenAI `/v1/responses` (SSE)"}
    base = mean("openai", "tok_per_s")
    lines = [
        f"Same gateway and engine; {args.num_prompts} random 128-token prompts, 64 greedy new "
        f"tokens, concurrency {args.concurrency}, {args.rounds} rounds, path order rotated "
        f"each round (means); clients at {args.client} priority.",
        "",
        f"Machine: {machine()}.",
        "",
        "| path | output tok/s | median TTFT (ms) | vs OpenAI | gateway CPU s / 1k tok "
        "outside engine | client CPU s / 1k tok |",
        "|---|---|---|---|---|---|",
    ]
    for name in args.paths:
        tps = mean(name, "tok_per_s")
        server = per_1k(name, "other_cpu_s")
        server_s = "n/a (--url)" if server is None else f"{server:.2f}"
        lines.append(f"| {labels[name]} | {tps:.1f} | {mean(name, 'median_ttft_ms'):.0f} | "
                     f"{tps / base:.3f}x | {server_s} | {per_1k(name, 'client_cpu_s'):.2f} |")
    for name in ("anthropic", "responses"):
        if {"openai-chat", name} <= set(args.paths):
            lines += ["", f"{labels[name]} vs OpenAI chat (plain text, same run): "
                          f"{mean(name, 'tok_per_s') / mean('openai-chat', 'tok_per_s'):.3f}x"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="default",
                        help="the gateway layout to start when --url is not given")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--client-priority", dest="client", choices=CLIENT_PRIORITIES,
                        default="realtime", help="scheduling of the clients (this process)")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"comma-separated, openai first (default: {','.join(PATHS)})")
    args = parser.parse_args()
    args.paths = args.paths.split(",")
    if args.paths[0] != "openai" or not set(args.paths) <= set(PATHS):
        parser.error(f"--paths must start with openai and name only {sorted(PATHS)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    proc = None
    url = args.url
    if url is None:
        target = LAYOUTS[args.layout]
        proc = STARTERS[target](MODEL, str(prepare_embedded_model(progress=False)), {})
        url = f"http://127.0.0.1:{PORTS[target]}"
    try:
        if proc is not None:
            wait_ready(url, MODEL, proc)
        args.client = realtime_client(args.client)  # after the start: the gateway stays normal
        rows = asyncio.run(measure(url, args, proc.pid if proc is not None else None))
    finally:
        if proc is not None:
            import subprocess

            stop(proc)
            subprocess.run([venv_bin("ray"), "stop", "--force"], capture_output=True)
    summary = summarize(rows, args)
    (RESULTS / "protocols.md").write_text(summary + "\n")
    # One row per (round, path), for notebooks/protocol_paths.ipynb.
    (RESULTS / "protocols.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print("\n" + summary)


if __name__ == "__main__":
    main()

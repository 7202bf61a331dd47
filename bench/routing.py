"""Routing by prefix on two replicas: this gateway's against Serve's default routing, Ray Serve
LLM's prefix-aware router (direct streaming, behind HAProxy, placed like the gateway) and one
replica alone, on shared-prefix load and on load that shares nothing (docs/results/benchmarks-2026-12-07.md,
"Routing by prefix").

    python bench/routing.py [--models tiny,embedded] [--targets single,default,prefix,...]
                            [--rounds 3] [--conversations 64] [--turns 6] [--concurrency 16]
                            [--think-s 1.0]

Workloads, per target and round, on one server start, each as sessions of turns,
``--concurrency`` sessions at a time, each turn sent after the previous one's answer and a
think time (exponential, mean ``--think-s``: users read and type, so other users' turns come in
between; without it a closed loop kept each client on the replica that had just answered it,
HAProxy's least-connections choice, an affinity no real load has):

- ``multi-turn``: conversations that resend their whole history each turn (OpenAI chat,
  streamed), each opening with one of a few shared system prompts and a long context of its
  own in its first question (a document, an agent's task);
- ``unique``: as many sessions whose turns are prompts of their own, as long as the
  conversations' at the same turn, sharing nothing.

Per target and workload: TTFT p50 / p90, output throughput, and the prefix-cache hit rate: the
prompt tokens vLLM found in its prefix cache over all prompt tokens (vLLM's own per-request
count, ``usage.prompt_tokens_details.cached_tokens``). Each round's ratio to Serve's default
routing is one reading; the rounds are pooled (``bench.pooled``). Writes
``bench/results/routing-<time>.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import servers
from bench.load import CLIENT_PRIORITIES, realtime_client
from bench.pooled import pool

# Target -> how it starts. Two replicas each, but ``single``.
TARGETS: dict[str, Callable] = {
    "single": functools.partial(servers.serve_model_apps, options={"num_replicas": 1}),
    "default": functools.partial(servers.serve_model_apps,
                                 options={"num_replicas": 2, "routing": {"policy": "load"}}),
    "prefix": functools.partial(servers.serve_model_apps, options={"num_replicas": 2}),
    "serve-llm-prefix": functools.partial(servers.serve_llm, replicas=2, router="prefix"),
    "serve-llm": functools.partial(servers.serve_llm, replicas=2),
}
PEER = {"single": "gateway", "default": "gateway", "prefix": "gateway",
        "serve-llm-prefix": "serve-llm", "serve-llm": "serve-llm"}
BASELINE = "default"
MAX_TOKENS = 24
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "den", "por", "gal", "ith", "um",
              "ber", "cas", "dro", "fen", "hul", "jor", "kel"]


class Reading(msgspec.Struct, frozen=True):
    ttft_s: float
    prompt: int
    cached: int
    completion: int


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))) for _ in range(n))


class Session(msgspec.Struct, frozen=True):
    """One user's turns. ``history``: each turn resends the conversation so far (its opening
    system prompt, every earlier question and answer) and a new question; otherwise each turn is
    a prompt of its own (``turns`` hold whole message lists), sharing nothing."""

    history: bool
    turns: tuple[tuple[dict, ...], ...]


def workloads(seed: int, conversations: int, turns: int, systems: int = 4,
              system_words: int = 200, context_words: int = 700,
              user_words: int = 40) -> dict[str, list[Session]]:
    """``multi-turn``: conversations opening with one of ``systems`` shared system prompts and
    a first question carrying a long context of its own (a document, an agent's task: what a
    replica must hold to answer the next turns cheaply); ``unique``: as many sessions of as many
    turns, each turn's prompt as long as the conversation's at that turn, and each its own."""
    rng = random.Random(seed)
    shared = [_words(rng, system_words) for _ in range(systems)]
    multi = [Session(history=True, turns=(
        ({"role": "system", "content": shared[c % systems]},
         {"role": "user", "content": _words(rng, context_words + user_words)}),
        *(({"role": "user", "content": _words(rng, user_words)},) for _ in range(turns - 1))))
        for c in range(conversations)]
    opening = system_words + context_words
    unique = [Session(history=False, turns=tuple(
        ({"role": "system", "content": _words(rng, opening + t * (user_words + MAX_TOKENS))},
         {"role": "user", "content": _words(rng, user_words)}) for t in range(turns)))
        for _ in range(conversations)]
    return {"multi-turn": multi, "unique": unique}


async def _turn(http: aiohttp.ClientSession, url: str, model: str,
                messages: list[dict]) -> tuple[Reading, str]:
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started, first, text, usage = time.perf_counter(), None, [], None
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {(await response.text())[:300]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return Reading(ttft_s=(first or time.perf_counter()) - started, prompt=usage["prompt_tokens"],
                   cached=details.get("cached_tokens") or 0,
                   completion=usage["completion_tokens"]), "".join(text)


async def run_workload(url: str, model: str, sessions: list[Session], concurrency: int,
                       think_s: float, seed: int) -> tuple[list[Reading], int, float]:
    """Every session, ``concurrency`` at a time, each turn after the previous one's answer and
    a think time (exponential, mean ``think_s``: users read and type, so other users' turns
    come in between, as they do on a shared server): the readings, the failed turns (a failed
    turn ends its session) and the wall time."""
    queue: asyncio.Queue = asyncio.Queue()
    for session in sessions:
        queue.put_nowait(session)
    readings: list[Reading] = []
    failed = 0
    rng = random.Random(seed)

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal failed
        while not queue.empty():
            session, history = queue.get_nowait(), []
            for turn in session.turns:
                history = [*history, *turn] if session.history else list(turn)
                try:
                    reading, answer = await _turn(http, url, model, history)
                except Exception as exc:
                    print(f"failed turn: {exc!r}", file=sys.stderr)
                    failed += 1
                    break
                readings.append(reading)
                history.append({"role": "assistant", "content": answer})
                await asyncio.sleep(rng.expovariate(1 / think_s) if think_s else 0)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        started = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        return readings, failed, time.perf_counter() - started


def summary(readings: list[Reading], failed: int, wall_s: float) -> dict:
    ttfts = sorted(r.ttft_s for r in readings)
    cut = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else ttfts * 9
    prompt = sum(r.prompt for r in readings)
    return {"requests": len(readings), "failed": failed,
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
            "ttft_p90_ms": round(cut[8] * 1000, 1),
            "throughput_tok_s": round(sum(r.completion for r in readings) / wall_s, 1),
            "requests_per_s": round(len(readings) / wall_s, 3),
            "hit_rate": round(sum(r.cached for r in readings) / prompt, 4) if prompt else None,
            "wall_s": round(wall_s, 1)}


def measure(args) -> list[dict]:
    rows = []
    for model, model_dir, overrides in _models(args.models):
        loads = workloads(args.seed, args.conversations, args.turns)
        for rnd in range(args.rounds):
            turn = rnd % len(args.targets)  # each round starts with another target
            for target in args.targets[turn:] + args.targets[:turn]:
                proc = TARGETS[target](model, model_dir, overrides)
                try:
                    placed = servers.serve_ready(PEER[target], model, proc)
                    url = f"http://127.0.0.1:{servers.PORTS[PEER[target]]}"
                    for name, sessions in loads.items():
                        got = asyncio.run(run_workload(url, model, sessions, args.concurrency,
                                                       args.think_s, args.seed + rnd))
                        row = {"model": model, "target": target, "round": rnd,
                               "workload": name, "peer_placement": placed, **summary(*got)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                finally:
                    servers.stop_tree(proc, PEER[target])
    return rows


def _models(names: list[str]) -> list[tuple[str, str, dict]]:
    """The benches' models; the tiny one built with room for the conversations' history."""
    out = []
    for name in names:
        if name == "tiny":
            embedded = str(servers.prepare_embedded_model())
            path = servers.build_tiny(Path(servers.tempfile.mkdtemp(prefix="tiny-")),
                                      Path(embedded), max_positions=4096)
            out.append((servers.TINY_NAME, str(path), {"max_model_len": 4096}))
        else:
            out += servers.models([name])
    return out


def ratios(rows: list[dict], metric: str) -> dict[tuple[str, str, str], dict]:
    """Per model, workload and target: each round's ``metric`` over the baseline's in that
    round, pooled over rounds."""
    base = {(r["model"], r["workload"], r["round"]): r[metric] for r in rows
            if r["target"] == BASELINE}
    readings: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        b = base.get((r["model"], r["workload"], r["round"]))
        if r["target"] != BASELINE and b and r[metric] is not None:
            readings.setdefault((r["model"], r["workload"], r["target"]), []).append(r[metric] / b)
    return {key: msgspec.to_builtins(pool(values)) for key, values in readings.items()}


def report(rows: list[dict], args) -> str:
    lines = [f"{args.concurrency} sessions at a time, {args.conversations} sessions of "
             f"{args.turns} turns ({MAX_TOKENS} tokens an answer, think time {args.think_s} s "
             f"on average), {args.rounds} rounds; "
             f"{servers.machine()}; load generator at {args.client} priority.", "",
             "| model | workload | target | TTFT p50 ms | TTFT p90 ms | output tok/s | "
             "hit rate | failed |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['workload']} | {r['target']} (round {r['round']}) | "
                     f"{r['ttft_p50_ms']} | {r['ttft_p90_ms']} | {r['throughput_tok_s']} | "
                     f"{r['hit_rate']} | {r['failed']} |")
    for metric in ("ttft_p50_ms", "ttft_p90_ms", "throughput_tok_s"):
        lines += ["", f"{metric} against Serve's default routing (pooled over rounds):"]
        for (model, workload, target), got in sorted(ratios(rows, metric).items()):
            text = pool(got["readings"]).text()
            lines.append(f"- {model}, {workload}, {target}: {text}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    split = lambda text: [t for t in text.split(",") if t]  # noqa: E731
    parser.add_argument("--models", type=split, default=["tiny"])
    parser.add_argument("--targets", type=split, default=["single", BASELINE, "prefix",
                                                          "serve-llm-prefix"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client", choices=CLIENT_PRIORITIES, default="realtime")
    args = parser.parse_args()
    unknown = set(args.targets) - set(TARGETS)
    if unknown or BASELINE not in args.targets:
        raise SystemExit(f"targets among {sorted(TARGETS)}, {BASELINE!r} included")
    args.client = realtime_client(args.client)
    rows = measure(args)
    servers.write_results("routing", args, rows, report(rows, args))


if __name__ == "__main__":
    main()

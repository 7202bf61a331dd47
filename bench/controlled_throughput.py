"""Throughput of controlled generation vs unconstrained, same engine, same run (issue 12).

One ``vllm`` engine of the embedded model with its controller runtime in a process of its own
(as in a replica: Ray is initialised), 16 concurrent streams, greedy, ``max_tokens`` each.
Three cases, alternated over ``--rounds``:

- ``plain``: no controller (the hook is installed but idle);
- ``none``: the no-op controller (one runtime round trip per step, all tokens allowed);
- ``regex``: llguidance ``[a-z ,.]{300,}`` (a mask every step). At least 300 characters, so
  no stream may end before its token budget: with ``[a-z ,.]+`` a quarter of the streams
  ended early and the case ran at a smaller batch than the others (output tokens are still
  counted, not assumed).

Usage::

    python bench/controlled_throughput.py [--streams 16] [--max-tokens 64] [--rounds 3]

Each row also has the CPU milliseconds per output token of this process (the frontend: the
driver of controlled runs and vLLM's output processing), of vLLM's engine processes, and of the
rest (Ray, and the controller runtime's process), read with psutil before and after the case
(``bench/cputime.py``): where a controller's cost goes.

Writes ``bench/results/controlled_throughput.json`` with the CPU flags and dtype. Run it on an
idle box (nothing else using the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pipeline import _cpu_flags  # noqa: E402

PROMPTS = ["Write a short story about a lighthouse keeper", "Describe the city of Paris",
           "Explain how rain forms", "List some things to do on a sunny day"]
REGEX = {"grammar": {"grammars": [{"lark_grammar": "start: /[a-z ,.]{300,}/"}]}}


async def _one(engine, i: int, case: str, max_tokens: int) -> tuple[int, float, float]:
    from contract import (
        ControllerSpec,
        ErrorEvent,
        GenerateRequest,
        Sampling,
        TextPrompt,
        TokenEvent,
    )
    from engines.kit.base import Admitted

    controller = {"plain": None, "none": ControllerSpec(module="none"),
                  "regex": ControllerSpec(module="llguidance", arg=json.dumps(REGEX))}[case]
    request = GenerateRequest(
        request_id=f"{case}-{i}-{time.monotonic_ns()}", model="m",
        prompt=TextPrompt(text=PROMPTS[i % len(PROMPTS)] + f" (#{i})."),
        sampling=Sampling(temperature=0.0, max_tokens=max_tokens,
                          ignore_eos=controller is None),  # controlled runs ignore EOS anyway
        controller=controller)
    ids = engine.render(request.prompt)
    tokens, t0, ttft = 0, time.perf_counter(), 0.0
    async for event in engine.stream(request, Admitted(prompt_ids=ids, max_tokens=max_tokens)):
        if isinstance(event, TokenEvent):
            tokens += 1
            ttft = ttft or time.perf_counter() - t0
        elif isinstance(event, ErrorEvent):  # a stream cut short is reported, not hidden
            print(f"{case} stream {i} failed after {tokens} tokens: {event.message}",
                  file=sys.stderr, flush=True)
    tpot = (time.perf_counter() - t0 - ttft) / max(tokens - 1, 1)
    return tokens, ttft, tpot


def _cpu_by_part() -> dict[str, float]:
    from bench.cputime import snapshot

    own = os.getpid()
    parts = {"frontend": 0.0, "engine": 0.0, "rest": 0.0}
    for pid, (is_engine, cpu) in snapshot(own).items():
        parts["frontend" if pid == own else "engine" if is_engine else "rest"] += cpu
    return parts


async def _case(engine, case: str, streams: int, max_tokens: int) -> dict:
    cpu0 = _cpu_by_part()
    t0 = time.perf_counter()
    done = await asyncio.gather(*(_one(engine, i, case, max_tokens) for i in range(streams)))
    wall = time.perf_counter() - t0
    cpu1 = _cpu_by_part()
    counts = [n for n, _, _ in done]
    tokens = max(sum(counts), 1)
    return {"case": case, "tokens": sum(counts), "wall_s": round(wall, 3),
            "tok_s": round(sum(counts) / wall, 2),
            "ttft_p50_ms": round(statistics.median(t for _, t, _ in done) * 1000, 1),
            "tpot_p50_ms": round(statistics.median(t for _, _, t in done) * 1000, 2),
            **{f"cpu_ms_per_tok_{part}": round((cpu1[part] - cpu0[part]) * 1000 / tokens, 3)
               for part in cpu0}}


async def _run(args: argparse.Namespace) -> dict:
    from engines.kit.config import ModelConfig
    from engines.vllm.engine import VLLMEngine

    engine = VLLMEngine(ModelConfig())
    await _case(engine, "regex", 2, 8)  # warm-up: grammar compile paths, the runtime's pool
    rows = []
    for r in range(args.rounds):
        for case in ("plain", "none", "regex"):
            row = {"round": r, **await _case(engine, case, args.streams, args.max_tokens)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    means = {c: statistics.mean(x["tok_s"] for x in rows if x["case"] == c)
             for c in ("plain", "none", "regex")}
    return {"rows": rows, "mean_tok_s": means,
            "vs_plain": {c: round(v / means["plain"], 3) for c, v in means.items()},
            "dtype": engine.model_info().dtype}


def measure_throughput(streams: int = 16, max_tokens: int = 64, rounds: int = 3) -> dict:
    """The three cases, alternated over ``rounds``, in a Ray instance of its own (also run
    by ``bench/controllers.py --throughput``)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        args = argparse.Namespace(streams=streams, max_tokens=max_tokens, rounds=rounds)
        return asyncio.run(_run(args))
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result = measure_throughput(args.streams, args.max_tokens, args.rounds)
    out = {"machine": {"cpu_flags": _cpu_flags(), "cores": os.cpu_count(),
                       "python": platform.python_version()},
           "command": " ".join(["python", "bench/controlled_throughput.py", *sys.argv[1:]]),
           **result}
    path = ROOT / "bench" / "results" / "controlled_throughput.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["vs_plain"]), f"wrote {path}")


if __name__ == "__main__":
    main()

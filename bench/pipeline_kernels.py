"""The pipeline's CPU kernels under prompts of mixed lengths: ``cpu_kernels: packed`` (the
default) against ``torch``, 16 sequences at once, each with a prompt of another length (3 to
108 words) and ``--tokens`` greedy tokens, so micro-batches meet many row counts (oneDNN builds
a kernel per row count and weight shape, once: docs/protocols/pipeline.md, "CPU kernels").

Usage::

    python bench/pipeline_kernels.py [--rounds 3] [--tokens 32] [--stages 2]

Both pipelines measured round-robin in one run, every round reported (the first includes
building the kernels). Run it on an idle box; it records the CPU flags. docs/results/benchmarks-2026-12-07.md,
"Packed weights".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.pipeline import _cpu_flags, _pipeline

SEQUENCES = 16
_WORDS = ("the lighthouse keeper walked along the shore at dawn looking for bottles and shells "
          "while the sea rolled in grey and cold under a sky of low clouds and wind ").split()


def prompt(i: int) -> str:
    """Sequence ``i``'s prompt: 3 + 7 i words."""
    return " ".join((_WORDS * 10)[:3 + 7 * i])


async def tokens_per_s(host, tokens: int, tag: str) -> float:
    from contract import GenerateRequest, Sampling, TextPrompt, TokenEvent

    async def one(i: int) -> int:
        request = GenerateRequest(request_id=f"{tag}-{i}-{time.monotonic_ns()}", model="m",
                                  prompt=TextPrompt(text=prompt(i)),
                                  sampling=Sampling(temperature=0, max_tokens=tokens,
                                                    ignore_eos=True))
        return len([e async for e in host.generate(request) if isinstance(e, TokenEvent)])

    start = time.perf_counter()
    got = sum(await asyncio.gather(*(one(i) for i in range(SEQUENCES))))
    return got / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--stages", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_worker_niceness", "0")  # as the gateway starts Ray
    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(include_dashboard=False, log_to_driver=False)
    pipes = {kernels: _pipeline(args.stages, "float32", 1, {"cpu_kernels": kernels})
             for kernels in ("packed", "torch")}
    rounds: dict[str, list[float]] = {kernels: [] for kernels in pipes}

    async def run() -> None:
        for i in range(args.rounds):
            for kernels, (_, host) in pipes.items():
                rounds[kernels].append(round(await tokens_per_s(host, args.tokens,
                                                                f"{kernels}{i}"), 2))
                print(kernels, i, rounds[kernels][-1], flush=True)

    try:
        asyncio.run(run())
    finally:
        ray.shutdown()
    print(json.dumps({"cpu_flags": _cpu_flags(), "dtype": "float32", "sequences": SEQUENCES,
                      "tokens": args.tokens, "stages": args.stages,
                      "tokens_per_s": rounds,
                      "packed_over_torch": [round(p / t, 3) for p, t in
                                            zip(rounds["packed"], rounds["torch"], strict=True)]}))


if __name__ == "__main__":
    main()

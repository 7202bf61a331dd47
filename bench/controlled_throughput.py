"""Throughput of controlled generation vs unconstrained, same engine, same run (issue 12).

One ``vllm`` engine of the embedded model with its controller runtime in a Ray actor (as in a
replica), 16 concurrent streams, greedy, ``max_tokens`` each. Three cases, alternated over
``--rounds``:

- ``plain``: no controller (the hook is installed but idle);
- ``none``: the no-op controller (one runtime round trip per step, all tokens allowed);
- ``regex``: llguidance ``[a-z ,.]+`` (a mask every step; the model may end early only where
  the grammar accepts, so output tokens are counted, not assumed).

Usage::

    python bench/controlled_throughput.py [--streams 16] [--max-tokens 64] [--rounds 3]

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
REGEX = {"grammar": {"grammars": [{"lark_grammar": "start: /[a-z ,.]+/"}]}}


async def _one(engine, i: int, case: str, max_tokens: int) -> int:
    from engines.base import Admitted
    from protocols.internal import ControllerSpec, GenerateRequest, Sampling, TextPrompt, TokenEvent

    controller = {"plain": None, "none": ControllerSpec(module="none"),
                  "regex": ControllerSpec(module="llguidance", arg=json.dumps(REGEX))}[case]
    request = GenerateRequest(
        request_id=f"{case}-{i}-{time.monotonic_ns()}", model="m",
        prompt=TextPrompt(text=PROMPTS[i % len(PROMPTS)] + f" (#{i})."),
        sampling=Sampling(temperature=0.0, max_tokens=max_tokens,
                          ignore_eos=controller is None),  # controlled runs ignore EOS anyway
        controller=controller)
    ids = engine.render(request.prompt)
    tokens = 0
    async for event in engine.stream(request, Admitted(prompt_ids=ids, max_tokens=max_tokens)):
        tokens += isinstance(event, TokenEvent)
    return tokens


async def _case(engine, case: str, streams: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(_one(engine, i, case, max_tokens) for i in range(streams)))
    wall = time.perf_counter() - t0
    return {"case": case, "tokens": sum(counts), "wall_s": round(wall, 3),
            "tok_s": round(sum(counts) / wall, 2)}


async def _run(args) -> dict:
    from engines.config import ModelConfig
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        result = asyncio.run(_run(args))
    finally:
        ray.shutdown()
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

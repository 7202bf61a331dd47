"""A pipeline stage's KV-cache memory under load, against its budget (``kv_cache_gib``): many
concurrent long requests on the embedded model, origin and stages in this process (no Ray), the
most bytes any stage held at once.

Usage::

    python bench/pipeline_memory.py [--requests 64] [--prompt-words 400] [--max-tokens 32]
                                    [--kv-cache-gib 0.25] [--dtype float32]

Prints one JSON line (also written to ``bench/results/pipeline_memory.json``) with the CPU
flags and dtype.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pipeline import _cpu_flags  # noqa: E402


def _engine(args):
    import torch

    from engines.kit.config import ModelConfig
    from engines.kit.embedded import prepare_embedded_model
    from engines.pipeline.engine import PipelineEngine
    from engines.pipeline.loading import load_layers
    from engines.pipeline.stage import StageCore
    from engines.pipeline.stages import LocalStages

    path = prepare_embedded_model(progress=False)
    dtype = getattr(torch, args.dtype)
    ranges = [(1, 15), (15, 30)]
    cores = [StageCore(load_layers(path, a, b, dtype), a, b) for a, b in ranges]
    most = {"bytes": 0}

    class Watched(LocalStages):
        def submit(self, hop, check):
            result = super().submit(hop, check)
            most["bytes"] = max(most["bytes"], *(core.cache_bytes() for core in self.cores))
            return result

    config = ModelConfig(name="m", engine="pipeline", source=str(path), engine_args={
        "stages": [list(r) for r in ranges], "dtype": args.dtype,
        "kv_cache_gib": args.kv_cache_gib, "max_sequences": args.requests})
    return PipelineEngine(config, stages=Watched(cores)), most


async def _run(args) -> dict:
    from contract import ErrorEvent, FinalEvent, GenerateRequest, Sampling, TextPrompt
    from engines.replica.host import EngineHost

    engine, most = _engine(args)
    host = EngineHost(engine)
    text = " ".join(f"word{i % 97}" for i in range(args.prompt_words))

    async def one(i: int) -> str:
        request = GenerateRequest(request_id=f"mem-{i}", model="m", prompt=TextPrompt(text=text),
                                  sampling=Sampling(temperature=0, max_tokens=args.max_tokens,
                                                    ignore_eos=True))
        last = [e async for e in host.generate(request)][-1]
        return "done" if isinstance(last, FinalEvent) else (
            last.kind if isinstance(last, ErrorEvent) else "?")

    started = time.perf_counter()
    ends = await asyncio.gather(*(one(i) for i in range(args.requests)))
    prompt_tokens = len(engine.tokenizer.encode(text))
    from engines.pipeline.budget import bytes_per_token
    from engines.pipeline.loading import load_config, text_config

    tcfg = text_config(load_config(engine.model_path))
    widest = max(end - start for start, end in engine.ranges)  # the stage the budget sizes
    per_token = bytes_per_token(tcfg, widest, engine.dtype.itemsize)
    return {"requests": args.requests, "prompt_tokens": prompt_tokens,
            "max_tokens": args.max_tokens, "ends": {e: ends.count(e) for e in set(ends)},
            "budget_tokens": engine.kv_budget.tokens,
            "budget_bytes": engine.kv_budget.tokens * per_token,
            "most_stage_cache_bytes": most["bytes"],
            "wall_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    result = asyncio.run(_run(args))
    result.update(cpu_flags=_cpu_flags(), dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                  command="python " + " ".join(sys.argv))
    out = ROOT / "bench" / "results" / "pipeline_memory.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

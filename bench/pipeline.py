"""Pipeline stages vs one process vs vLLM: the embedded model, same machine, one run.

Measures greedy decoding (``ignore_eos``) of the same prompt as tokens/s and per-token latency:

- ``hf``: the unsplit HF model in this process, no Ray (a cached greedy loop, one sequence);
  ``hf-batch``: ``generate`` over a batch of each concurrency above 1;
- ``pipeline-N``: the ``pipeline`` engine kind with N stage actors (plus the origin's first
  layer) on a local Ray, through ``EngineHost`` (no HTTP), at each concurrency;
- ``vllm``: vLLM's ``AsyncLLM`` in this process, same dtype, at each concurrency;
- with ``--compare-kernels``, every pipeline also with ``cpu_kernels: torch`` (``-torch``: torch's
  plain linear layers instead of weights packed for oneDNN, the default on CPU), and
  ``hf-packed``: the unsplit loop with the same packed weights, so the split's own cost is
  read against the same kernels;
- with ``--controllers none regex``, every pipeline and vLLM target also with each request
  under that controller (``+none``: the no-op controller, the controller path's own cost;
  ``+regex``: an llguidance regex of lowercase words), measured in the same rounds.

Usage::

    python bench/pipeline.py [--tokens 64] [--rounds 3] [--stages 1 2 4] [--concurrency 1 4 16]
                             [--dtype float32] [--threads 1] [--controllers none regex]

Targets are measured round-robin, ``--rounds`` times, and medians reported: on a shared host the
speed drifts by tens of percent within minutes, so only side-by-side numbers compare. vLLM sizes
its own CPU threads (all cores); ``--threads`` applies to the HF process, the origin and every
stage.

Prints a table and writes ``bench/results/pipeline.json``. Run it on an idle box (nothing else
using the CPU); it records the CPU flags and dtype next to the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def _cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return " ".join(f for f in wanted if f in flags)


def _row(name: str, seqs: int, tokens: int, wall: float, per_token: list[float]) -> dict:
    return {"target": name, "sequences": seqs, "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2),
            "per_token_ms_p50": round(1000 * statistics.median(per_token), 2) if per_token else None}


class HF:
    """The unsplit model in this process: a cached greedy loop (one sequence) and ``generate``
    over a batch."""

    def __init__(self, path: str, dtype, packed: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from engines.pipeline.kernels import pack_linears

        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        if packed:  # every projection and the LM head, as the pipeline packs them
            pack_linears(self.model)
        self.ids = self.tok.encode(PROMPT)

    def single(self, tokens: int) -> tuple[float, list[float]]:
        import torch
        from transformers import DynamicCache

        with torch.inference_mode():
            cache, stamps = DynamicCache(config=self.model.config), []
            start = time.perf_counter()
            out = self.model(torch.tensor([self.ids]), past_key_values=cache, use_cache=True)
            for _ in range(tokens):
                nxt = out.logits[0, -1].argmax()
                stamps.append(time.perf_counter())
                out = self.model(nxt.view(1, 1), past_key_values=cache, use_cache=True)
            return time.perf_counter() - start, [b - a for a, b in itertools.pairwise(stamps)]

    def batch(self, tokens: int, size: int) -> float:
        import torch

        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(torch.tensor([self.ids] * size), max_new_tokens=tokens,
                                min_new_tokens=tokens, do_sample=False,
                                pad_token_id=self.tok.eos_token_id)
        return time.perf_counter() - start


# What ``--controllers`` names: (module, arg). The grammar ends only after three snowmen, which
# no greedy continuation here writes: the budget ends a request, as ``ignore_eos`` does for the
# others.
CONTROLLERS = {
    "none": ("none", ""),
    "regex": ("llguidance", json.dumps({"grammar": {"grammars": [
        {"lark_grammar": 'start: /[a-z ,.]+/ "☃☃☃"'}]}})),
}


async def _drive(host, tokens: int, seqs: int, tag: str,
                 controller: str | None = None) -> tuple[float, list[float], int]:
    """``seqs`` concurrent requests of ``tokens`` each: the wall time, the gaps between
    tokens, and the tokens received."""
    from contract import ControllerSpec, GenerateRequest, Sampling, TextPrompt, TokenEvent

    spec = None if controller is None else ControllerSpec(module=CONTROLLERS[controller][0],
                                                          arg=CONTROLLERS[controller][1])

    async def one(i: int) -> list[float]:
        request = GenerateRequest(request_id=f"{tag}-{i}-{time.monotonic_ns()}", model="m",
                                  prompt=TextPrompt(text=PROMPT),
                                  sampling=Sampling(temperature=0, max_tokens=tokens,
                                                    ignore_eos=True), controller=spec)
        stamps = [time.perf_counter() async for e in host.generate(request)
                  if isinstance(e, TokenEvent)]
        assert len(stamps) == tokens, f"{tag}: {len(stamps)} tokens"
        return [b - a for a, b in itertools.pairwise(stamps)]

    start = time.perf_counter()
    steps = await asyncio.gather(*(one(i) for i in range(seqs)))
    return time.perf_counter() - start, [s for seq in steps for s in seq], seqs * tokens


def _pipeline(stages: int, dtype: str, threads: int, extra: dict):
    from engines.kit.config import ModelConfig
    from engines.pipeline.engine import PipelineEngine
    from engines.replica.host import EngineHost

    engine = PipelineEngine(ModelConfig(name="m", engine="pipeline", engine_args={
        "num_stages": stages, "dtype": dtype, "stage_num_cpus": 0.01, "stage_threads": threads,
        "origin_threads": threads, **extra}))
    return engine, EngineHost(engine)


def _merge(name: str, runs: list[tuple[int, int, float, list[float]]]) -> list[dict]:
    """Per concurrency: the median wall time over rounds and the median per-token latency."""
    rows = []
    for seqs in sorted({r[0] for r in runs}):
        mine = [r for r in runs if r[0] == seqs]
        wall = statistics.median(r[2] for r in mine)
        steps = [s for r in mine for s in r[3]]
        rows.append(_row(name, seqs, mine[0][1], wall, steps))
    return rows


def _targets(args, path: str) -> tuple[dict[str, Any], Any]:
    """The engines measured (name -> (engine, host)): each pipeline (and, with
    ``--compare-kernels``, each on torch's layers), then vLLM unless ``--no-vllm``."""
    extra = json.loads(args.engine_args)
    pipes = {str(n): _pipeline(n, args.dtype, args.threads, extra) for n in args.stages}
    if args.compare_kernels:
        pipes.update({f"{n}-torch": _pipeline(n, args.dtype, args.threads,
                                              {**extra, "cpu_kernels": "torch"})
                      for n in args.stages})
    if args.no_vllm:
        return pipes, None
    from engines.kit.config import ModelConfig
    from engines.replica.host import EngineHost
    from engines.vllm.engine import VLLMEngine

    vllm = VLLMEngine(ModelConfig(name="m", source=path, engine_args={
        "dtype": args.dtype, "max_model_len": 2048}))
    pipes["vllm"] = (vllm, EngineHost(vllm))
    return pipes, vllm


def run_all(args) -> list[dict]:
    """Round-robin over every target, ``args.rounds`` times (a noisy shared host drifts; what
    is compared was measured side by side), then medians."""
    import ray
    import torch

    from engines.kit.embedded import prepare_embedded_model

    path = str(prepare_embedded_model())
    dtype = getattr(torch, args.dtype)
    hf = HF(path, dtype)
    hf_packed = HF(path, dtype, packed=True) if args.compare_kernels else None
    ray.init(include_dashboard=False, log_to_driver=False)
    pipes, vllm = _targets(args, path)
    runs: dict[str, list] = {"hf": [], "hf-batch": [], "hf-packed": []}

    async def rounds() -> None:
        for _, host in pipes.values():
            await _drive(host, 8, 1, "warm")
            for controller in args.controllers:
                await _drive(host, 8, 1, "warm", controller)
        for warm in (hf, hf_packed):
            if warm is not None:
                warm.single(8)
        t = args.tokens
        for _ in range(args.rounds):
            wall, steps = hf.single(t)
            runs["hf"].append((1, t, wall, steps))
            if hf_packed is not None:
                wall, steps = hf_packed.single(t)
                runs["hf-packed"].append((1, t, wall, steps))
            for seqs in args.concurrency:
                if seqs > 1:
                    runs["hf-batch"].append((seqs, seqs * t, hf.batch(t, seqs), []))
            for key, (_, host) in pipes.items():
                name = key if key == "vllm" else f"pipeline-{key}"
                for controller in (None, *args.controllers):
                    tagged = name if controller is None else f"{name}+{controller}"
                    for seqs in args.concurrency:
                        wall, steps, got = await _drive(host, t, seqs, tagged, controller)
                        runs.setdefault(tagged, []).append((seqs, got, wall, steps))

    try:
        asyncio.run(rounds())
    finally:
        if vllm is not None:
            vllm._llm.shutdown()
        ray.shutdown()
    return [row for name, r in runs.items() if r for row in _merge(name, r)]


def _ratios(rows: list[dict]) -> None:
    """Per row: per-token latency against the unsplit loop (one sequence), throughput against
    the same target's single sequence and against vLLM's at the same concurrency."""
    by = {(r["target"], r["sequences"]): r for r in rows}
    hf, packed = by[("hf", 1)], by.get(("hf-packed", 1))
    for row in rows:
        if row["per_token_ms_p50"] and row["sequences"] == 1:
            row["per_token_vs_hf"] = round(row["per_token_ms_p50"] / hf["per_token_ms_p50"], 3)
            if packed:
                row["per_token_vs_hf_packed"] = round(
                    row["per_token_ms_p50"] / packed["per_token_ms_p50"], 3)
        single = by.get((row["target"], 1))
        if single and row["sequences"] > 1:
            row["throughput_vs_single"] = round(row["tokens_per_s"] / single["tokens_per_s"], 2)
        vllm = by.get(("vllm", row["sequences"]))
        if vllm and row["target"] != "vllm":
            row["throughput_vs_vllm"] = round(row["tokens_per_s"] / vllm["tokens_per_s"], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the HF process, the origin and each stage")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--compare-kernels", action="store_true",
                        help="also every pipeline with torch's plain linears, and hf-packed")
    parser.add_argument("--controllers", nargs="*", default=[], choices=sorted(CONTROLLERS),
                        help="also run each pipeline / vLLM target under these controllers")
    parser.add_argument("--engine-args", default="{}",
                        help="JSON: more engine_args for every pipeline (e.g. batches_in_flight)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from gateway.serve_env import SERVE_ENV

    # As the gateway starts Ray: stage actors at nice 0, not Ray's default 15.
    os.environ.setdefault("RAY_worker_niceness", SERVE_ENV["RAY_worker_niceness"])
    import torch

    torch.set_num_threads(args.threads)
    rows = run_all(args)
    _ratios(rows)
    meta = {"cpu_flags": _cpu_flags(), "cores": os.cpu_count(), "dtype": args.dtype,
            "threads": args.threads, "tokens": args.tokens, "torch": torch.__version__,
            "command": "python " + " ".join(sys.argv)}
    out = ROOT / "bench" / "results" / "pipeline.json"
    out.parent.mkdir(parents=True, exist_ok=True)  # ignored by git: absent in a fresh checkout
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(json.dumps(meta))
    print(f"{'target':<18} {'seqs':>4} {'tok/s':>8} {'ms/tok p50':>10} {'vs hf':>6} "
          f"{'vs hf-packed':>12} {'x single':>8} {'x vllm':>6}")
    for r in rows:
        print(f"{r['target']:<18} {r['sequences']:>4} {r['tokens_per_s']:>8} "
              f"{r['per_token_ms_p50'] or '-':>10} {r.get('per_token_vs_hf', '-'):>6} "
              f"{r.get('per_token_vs_hf_packed', '-'):>12} "
              f"{r.get('throughput_vs_single', '-'):>8} {r.get('throughput_vs_vllm', '-'):>6}")


if __name__ == "__main__":
    main()

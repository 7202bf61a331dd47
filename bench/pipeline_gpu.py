"""The pipeline's micro-batches against the unsplit HF model on one device, no Ray, no vLLM: only
torch, transformers and this repository (so it runs on a bare GPU box).

A random-weight Llama (default: 1.1 B parameters, hidden 2048, 22 layers, vocabulary 32000) is
written to a temporary checkpoint; then, for each number of sequences:

- ``hf``: the unsplit ``LlamaForCausalLM``, a greedy loop over a batch with one ``DynamicCache``;
- ``pipeline-N``: the origin (embedding, layer 0, head) and N in-process stages
  (``LocalStages``) through the origin's scheduler, the sequences run together as jobs.

Prompt ``--prompt`` tokens, ``--steps`` greedy steps, a warm-up then the median of ``--rounds``.
Each row also says how many sequences' greedy tokens (the warm-up's) equal the unsplit model's
to the end, and the earliest step where one departs (bf16 kernels round differently at a
different batch shape, so a near-tie may go the other way; fp32 should agree throughout).

Usage::

    python bench/pipeline_gpu.py [--device cuda] [--dtype bfloat16] [--sequences 1 16]
                                 [--stages 2] [--tiny]

``--tiny`` shrinks the model (a smoke run on a CPU box). Prints a table and writes
``bench/results/pipeline_gpu.json`` with the device, dtype and versions next to the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {"1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
         "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)}


def _checkpoint(size: str, directory: Path, dtype) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(directory)
    return directory


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _hf_loop(model, prompts, steps: int, device: str) -> tuple[float, list[list[int]]]:
    """Seconds for ``steps`` greedy steps of the whole batch (prefill excluded), and each
    sequence's greedy tokens."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(torch.tensor(prompts, device=device), past_key_values=cache, use_cache=True)
        _sync(device)
        start = time.perf_counter()
        picked = []
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            picked.append(nxt)
            out = model(nxt, past_key_values=cache, use_cache=True)
        _sync(device)
        wall = time.perf_counter() - start
    return wall, torch.cat(picked, dim=1).tolist()


async def _pipeline_run(origin, prompts, steps: int) -> tuple[float, list[list[int]]]:
    """Seconds from every sequence's first token to its last (prefill excluded), all together,
    and each sequence's greedy tokens."""
    import torch

    from engines.pipeline.jobs import Job, Sequence

    firsts, lasts = [], []
    tokens: list[list[int]] = [[] for _ in prompts]

    async def one(i: int, prompt: list[int]) -> None:
        seq = Sequence(seq_id=f"s{i}-{time.monotonic_ns()}", tokens=list(prompt))

        def step(logits, _prompt):
            seq.tokens.append(int(torch.argmax(logits)))
            return time.perf_counter(), len(seq.tokens) - len(prompt) > steps

        stamps = [t async for t in origin.generate(Job(seq, step))]
        firsts.append(stamps[0])
        lasts.append(stamps[-1])
        # The first token comes from the prefill, as the HF loop's first pick does.
        tokens[i] = seq.tokens[len(prompt):len(prompt) + steps]

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return max(lasts) - min(firsts), tokens


def _agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    """How far each sequence's greedy tokens follow the unsplit model's: the sequences equal to
    the end, and the earliest step where any sequence departs (bf16 near-ties may)."""
    departs = [next((k for k, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
               for g, w in zip(got, want, strict=True)]
    firsts = [k for k in departs if k is not None]
    return {"sequences_equal": departs.count(None), "first_departure": min(firsts, default=None)}


def _origin(path: Path, stages: int, layers: int, dtype, device: str, batch_tokens: int):
    from engines.pipeline.config import PipelineArgs, plan_stages
    from engines.pipeline.loading import load_layers, load_origin
    from engines.pipeline.origin import Origin
    from engines.pipeline.stage import StageCore
    from engines.pipeline.stages import LocalStages

    ranges = plan_stages(PipelineArgs(num_stages=stages), layers)  # after the origin's layer 0
    cores = [StageCore(load_layers(path, a, b, dtype).to(device), a, b, device=device,
                       host_hops=False) for a, b in ranges]
    return Origin(load_origin(path, 1, dtype).to(device), 1, LocalStages(cores),
                  prefill_chunk=512, max_restarts=0, check_digest=False, device=device,
                  max_batch_tokens=batch_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--stages", type=int, nargs="+", default=[2])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    size = "tiny" if args.tiny else "1.1b"
    dtype = getattr(torch, args.dtype)
    path = _checkpoint(size, Path(tempfile.mkdtemp(prefix="pipeline-gpu-")), dtype)
    layers = SIZES[size]["num_hidden_layers"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    origins = {n: _origin(path, n, layers, dtype, args.device, 16 * args.prompt)
               for n in args.stages}
    g = torch.Generator().manual_seed(1)
    rows = []
    for count in args.sequences:
        prompts = torch.randint(3, SIZES[size]["vocab_size"], (count, args.prompt),
                                generator=g).tolist()
        targets = {"hf": lambda p=prompts: _hf_loop(hf, p, args.steps, args.device)}
        for n, origin in origins.items():
            targets[f"pipeline-{n}"] = (lambda p=prompts, o=origin:
                                        asyncio.run(_pipeline_run(o, p, args.steps)))
        want = None
        for name, run in targets.items():
            _, tokens = run()  # warm-up
            want = want or tokens  # the HF loop runs first
            wall = statistics.median(run()[0] for _ in range(args.rounds))
            rows.append({"target": name, "sequences": count,
                         "ms_per_step": round(1000 * wall / args.steps, 2),
                         "tokens_per_s": round(count * args.steps / wall, 1),
                         **_agreement(tokens, want)})
    by = {(r["target"], r["sequences"]): r for r in rows}
    for row in rows:
        row["vs_hf"] = round(row["tokens_per_s"] / by[("hf", row["sequences"])]["tokens_per_s"], 3)
    device = (torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    meta = {"device": device, "dtype": args.dtype, "model": size, "prompt": args.prompt,
            "steps": args.steps, "torch": torch.__version__,
            "transformers": transformers.__version__, "command": "python " + " ".join(sys.argv)}
    out = ROOT / "bench" / "results" / "pipeline_gpu.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(json.dumps(meta))
    print(f"{'target':<12} {'seqs':>4} {'ms/step':>8} {'tok/s':>8} {'vs hf':>6} "
          f"{'equal':>5} {'departs':>7}")
    for r in rows:
        print(f"{r['target']:<12} {r['sequences']:>4} {r['ms_per_step']:>8} "
              f"{r['tokens_per_s']:>8} {r['vs_hf']:>6} {r['sequences_equal']:>5} "
              f"{r['first_departure']!s:>7}")


if __name__ == "__main__":
    main()

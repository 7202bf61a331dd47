"""Writes notebooks/overhead.ipynb (unexecuted) from the cells below; execute it with
`jupyter-execute --inplace notebooks/overhead.ipynb` from the notebooks directory."""

from pathlib import Path

import nbformat

CELLS = [
    ("markdown", """# Per-token overhead: the gateway vs bare vLLM on an overhead-bound model

Rows from `bench/compare.py --models tiny` (issue 16): a random-weight 4-layer Llama (hidden
256) the engine runs almost for free, so what the serving stack costs per token dominates.
Servers run one after another on one 2-core box (AVX2, no AVX-512: the engine computes in
fp32), `vllm bench serve` random 128 -> 64 tokens, ignore_eos, at concurrency 1 and 16.
Throughput is compared **within a run** (ratio to bare vLLM's mean in the same file). *CPU
ms per token outside the engine* sums the CPU time of every process of the server except
vLLM's engine-core and worker processes (Serve's proxy, controller, ingress and engine
replicas, Ray's daemons; for bare vLLM its API server), read before and after the load:
the hardware-robust measure of overhead.

`before`: the gateway as of commit 7b13e26 (engine replica -> ingress -> Serve proxy, Ray actor
calls per streamed batch). `after`, one later run: the default layout again (`gateway`), the
fast layout `gateway-colocated-haproxy` (the engine inside the ingress replica,
`serve_config.colocated.yaml`, behind Ray Serve's HAProxy ingress, `LLM_GATEWAY_INGRESS=haproxy`:
no Ray hop between engine and client) and Ray Serve LLM (`serve-llm`, the peer)."""),
    ("code", """import json
import os
from collections import defaultdict
from pathlib import Path

import matplotlib.pyplot as plt

RUNS = {"before": Path(os.environ.get("BEFORE", "data/overhead-before-2026-11-25.json")),
        "after": Path(os.environ.get("AFTER", "data/overhead-after-2026-11-25.json"))}
rows = {run: json.loads(path.read_text()) for run, path in RUNS.items()}


def mean(xs):
    return sum(xs) / len(xs)


table = []
for run, rs in rows.items():
    groups = defaultdict(list)
    for r in rs:
        groups[r["target"], r["concurrency"]].append(r)
    for (target, conc), g in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        bare = mean([r["output_throughput"] for r in groups["bare", conc]])
        tps = mean([r["output_throughput"] for r in g])
        cpu = 1000 * sum(r["other_cpu_s"] for r in g) / sum(r["total_output_tokens"] for r in g)
        table.append({"run": run, "target": target, "c": conc, "rounds": len(g), "tok_s": tps,
                      "vs_bare": tps / bare, "ttft": mean([r["median_ttft_ms"] for r in g]),
                      "tpot": mean([r["median_tpot_ms"] for r in g]), "cpu_ms_tok": cpu})
print(f"{'run':7} {'target':26} {'c':>3} {'rounds':>6} {'tok/s':>7} {'vs bare':>7} "
      f"{'TTFT p50':>9} {'TPOT p50':>9} {'CPU ms/tok':>10}")
for t in table:
    print(f"{t['run']:7} {t['target']:26} {t['c']:3d} {t['rounds']:6d} {t['tok_s']:7.1f} "
          f"{t['vs_bare']:7.3f} {t['ttft']:9.1f} {t['tpot']:9.2f} {t['cpu_ms_tok']:10.2f}")"""),
    ("code", """fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
SHORT = {"gateway-colocated-haproxy": "colocated\\n+haproxy"}
c16 = [t for t in table if t["c"] == 16]
c1 = [t for t in table if t["c"] == 1]
axes[0].bar(range(len(c16)), [t["vs_bare"] for t in c16], color="tab:blue")
axes[0].axhline(0.9, color="red", linestyle="--", label="target 0.9x (tiny model)")
axes[0].set_title("c=16 output tok/s vs bare vLLM (same run)")
axes[1].bar(range(len(c16)), [t["cpu_ms_tok"] for t in c16], color="tab:orange")
axes[1].set_title("c=16 CPU ms per output token outside the engine")
axes[2].bar(range(len(c1)), [t["tpot"] for t in c1], color="tab:green")
axes[2].set_title("c=1 median TPOT (ms)")
for ax, rows_ in zip(axes, (c16, c16, c1)):
    ax.set_xticks(range(len(rows_)))
    ax.set_xticklabels([f"{t['run']}\\n{SHORT.get(t['target'], t['target'])}"
                        for t in rows_], fontsize=8)
axes[0].legend(loc="lower right")
fig.tight_layout()
plt.show()"""),
    ("markdown", """Reading it: bare vLLM spends well under 1 ms of CPU per token outside its
engine. The default layout spends several, on two Ray hops per streamed token (engine replica
-> ingress -> Serve proxy) whose cost is mostly in Ray's native core-worker and gRPC threads
(py-spy of the ingress under load shows little Python). Colocating the engine with the ingress
removes one hop, HAProxy in place of Serve's proxy actor the other: what is left is one process
doing what bare vLLM's API server does (HTTP, detokenizing, encoding) plus HAProxy's relay and
Serve's replica bookkeeping. On a 2-core box every millisecond of it is taken from the engine,
so throughput follows the CPU figure. docs/results/benchmarks-2026-12-07.md has the numbers."""),
    ("markdown", """## The embedded model, and the tiny model under contention

Two later runs on the same box, 3 rounds each at c=16 (`docs/results/benchmarks-2026-12-07.md`, "Per-token
overhead"): the embedded SmolLM2-135M, where each fp32 engine step is slow, and the tiny model
again with one busy process pinned to CPU 0 beside every server (`--hog`)."""),
    ("code", """MORE = {"embedded": Path("data/overhead-embedded-2026-11-25.json"),
        "tiny + hog": Path("data/overhead-hog-2026-11-25.json")}
more = []
for run, path in MORE.items():
    groups = defaultdict(list)
    for r in json.loads(path.read_text()):
        groups[r["target"]].append(r)
    bare = mean([r["output_throughput"] for r in groups["bare"]])
    for target, g in groups.items():
        tps = mean([r["output_throughput"] for r in g])
        cpu = 1000 * sum(r["other_cpu_s"] for r in g) / sum(r["total_output_tokens"] for r in g)
        more.append({"run": run, "target": target, "rounds": [r["output_throughput"] for r in g],
                     "vs_bare": tps / bare, "cpu_ms_tok": cpu})
        print(f"{run:11} {target:26} rounds {', '.join(f'{x:.1f}' for x in more[-1]['rounds'])}"
              f"  vs bare {tps / bare:.3f}  CPU ms/tok outside engine {cpu:.2f}")
fig, ax = plt.subplots(figsize=(9, 3.8))
ax.bar(range(len(more)), [t["vs_bare"] for t in more], color="tab:blue")
ax.axhline(0.97, color="red", linestyle="--", label="0.97x (embedded target)")
ax.axhline(0.95, color="purple", linestyle=":", label="0.95x (contention target)")
ax.set_xticks(range(len(more)))
ax.set_xticklabels([f"{t['run']}\\n{SHORT.get(t['target'], t['target'])}" for t in more],
                   fontsize=8)
ax.set_ylim(0, 1.15)
ax.set_title("c=16 output tok/s vs bare vLLM, same run")
ax.legend(loc="lower right")
fig.tight_layout()
plt.show()"""),
]


def main() -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "markdown"
                else nbformat.v4.new_code_cell(src) for kind, src in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    out = Path(__file__).resolve().parents[1] / "overhead.ipynb"
    nbformat.write(nb, out)
    print(out)


if __name__ == "__main__":
    main()

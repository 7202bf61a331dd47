"""Writes notebooks/metrics.ipynb from the cells below (unexecuted); run it with
`jupyter-execute --inplace` (or the e2e test's nbclient) against a running gateway and a
Prometheus scraping its Ray cluster (docs/observability.md)."""

from cells import write_notebook

CELLS = [
    ("markdown", """# TTFT and inter-token latency per protocol, from Prometheus

Sends a short mixed load of streamed requests through several protocols of a running gateway
(`GATEWAY_URL`, default `http://127.0.0.1:8000`), then asks Prometheus (`PROMETHEUS_URL`,
default `http://127.0.0.1:9090`, scraping the Ray cluster with `docs/grafana/prometheus.yml`)
for the gateway's own series: time to first token and inter-token latency per protocol, the
percentiles Prometheus computes from the histograms every replica exports through Ray
(docs/observability.md).

Figures are from whatever machine runs this notebook: on a 2-core CPU box they show the shape,
not a GPU's speed."""),
    ("code", """import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

GATEWAY_URL = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8000").rstrip("/")
PROMETHEUS_URL = os.environ.get("PROMETHEUS_URL", "http://127.0.0.1:9090").rstrip("/")
models = [m["id"] for m in httpx.get(f"{GATEWAY_URL}/v1/models", timeout=30).json()["data"]]
MODEL = os.environ.get("GATEWAY_MODEL", models[0])
PROMPT = "Once upon a time, in a small village by the sea, there lived"
TOKENS = int(os.environ.get("NOTEBOOK_TOKENS", "16"))
REQUESTS = int(os.environ.get("NOTEBOOK_REQUESTS", "4"))  # per protocol
print(f"{GATEWAY_URL} ({MODEL!r}), Prometheus at {PROMETHEUS_URL}")"""),
    ("markdown", """## Before the load: the histograms as they are

Ray's agents export what the replicas recorded a couple of seconds later and Prometheus
scrapes them. The histograms count since each replica started, so the figures of this load are
the difference of two readings: the buckets now, and the buckets once the load is counted."""),
    ("code", """SERIES = {"TTFT": "ray_llm_gateway_time_to_first_token_seconds",
          "ITL": "ray_llm_gateway_inter_token_latency_seconds"}


def buckets(series):
    \"\"\"protocol -> {upper bound: cumulative count}, summed over every replica.\"\"\"
    expr = f'sum by (le, protocol) ({series}_bucket{{model="{MODEL}"}})'
    answer = httpx.get(f"{PROMETHEUS_URL}/api/v1/query", params={"query": expr}, timeout=30)
    out = {}
    for item in answer.json()["data"]["result"]:
        bound = float(item["metric"]["le"])
        out.setdefault(item["metric"].get("protocol", ""), {})[bound] = float(item["value"][1])
    return out


before = {name: buckets(series) for name, series in SERIES.items()}"""),
    ("markdown", "## The load: streamed requests over five protocols, four at a time"),
    ("code", """CHAT = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
STREAMS = {
    "openai": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS,
                                   "stream": True}),
    "anthropic": ("/v1/messages", {"model": MODEL, "messages": CHAT, "max_tokens": TOKENS,
                                   "stream": True}),
    "responses": ("/v1/responses", {"model": MODEL, "input": CHAT[0]["content"],
                                    "max_output_tokens": TOKENS, "stream": True}),
    "tgi": ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS}}),
    "mindie": (f"/v2/models/{MODEL}/generate_stream",
               {"text_input": PROMPT, "parameters": {"max_new_tokens": TOKENS}}),
}


def stream(protocol):
    path, body = STREAMS[protocol]
    with httpx.stream("POST", GATEWAY_URL + path, json=body, timeout=300) as response:
        assert response.status_code == 200, (protocol, response.read())
        return protocol, sum(1 for line in response.iter_lines() if line.startswith("data:"))


started = time.time()
work = [protocol for _ in range(REQUESTS) for protocol in STREAMS]
with ThreadPoolExecutor(4) as pool:
    done = list(pool.map(stream, work))
window_s = time.time() - started
print(f"{len(done)} streams in {window_s:.1f} s")"""),
    ("markdown", """## This load's percentiles

The difference of the two readings is this load's histogram per protocol; a percentile is read
from it as Prometheus's `histogram_quantile` does (linear within the bucket it falls in)."""),
    ("code", """def load_buckets(name):
    now = buckets(SERIES[name])
    return {p: {b: c - before[name].get(p, {}).get(b, 0) for b, c in counts.items()}
            for p, counts in now.items()}


deadline = time.time() + 180  # until every stream of the load is counted
while True:
    after = {name: load_buckets(name) for name in SERIES}
    counted = {p: after["TTFT"].get(p, {}).get(float("inf"), 0) for p in STREAMS}
    if all(c >= REQUESTS for c in counted.values()) or time.time() > deadline:
        break
    time.sleep(2)


def quantile(q, counts):
    bounds = sorted(counts)
    total = counts[bounds[-1]]
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        if counts[bound] >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(counts[bound] - below, 1e-9)
        lower, below = bound, counts[bound]
    return lower


figures = {(name, q): {p: quantile(q, after[name][p]) for p in STREAMS if p in after[name]}
           for name in SERIES for q in (0.5, 0.95)}
print(f"{'protocol':<10} {'streams':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8}")
for p in STREAMS:
    print(f"{p:<10} {counted[p]:>7.0f} " + " ".join(
        f"{figures[(name, q)].get(p, float('nan')):>{9 if name == 'TTFT' else 8}.3f}"
        for name in SERIES for q in (0.5, 0.95)))"""),
    ("code", """import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
for ax, name in zip(axes, SERIES):
    for offset, q in ((-0.2, 0.5), (0.2, 0.95)):
        values = [figures[(name, q)].get(p, 0) * 1000 for p in STREAMS]
        ax.bar([i + offset for i in range(len(STREAMS))], values, width=0.4, label=f"p{int(q * 100)}")
    ax.set_xticks(range(len(STREAMS)), list(STREAMS))
    ax.set_ylabel("ms")
    ax.set_title(f"{name} per protocol, this load (from Prometheus)")
    ax.legend()
fig.tight_layout()"""),
]


if __name__ == "__main__":
    print(write_notebook(CELLS, "metrics.ipynb"))

"""Writes notebooks/multi_protocol_tour.ipynb from the cells below (unexecuted); run it with
`jupyter-execute --inplace` (or the e2e test's nbclient) against a running gateway."""

from cells import write_notebook

CELLS = [
    ("markdown", """# One gateway, every client: a tour

Connects to a running gateway (`GATEWAY_URL`, default `http://127.0.0.1:8000`; start one with
`bash scripts/serve.sh`, or `ray up cluster.yaml` + `serve deploy`), calls it with each
ecosystem's own client, then times every protocol path on the same prompts and plots latency
and tokens/s. The controller API (AICI `/v1/run`) joins this tour when it exists (issue 12).

Figures are from whatever machine runs this notebook. The committed outputs come from a 2-core
CPU VM (AVX-512 with bf16) running the embedded SmolLM2-135M on vLLM's CPU build. They show
the shape of the comparison, not the gateway's speed; `bench/` holds the measured benchmarks."""),
    ("code", """import json
import os
import time
import warnings

import httpx

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by LMQL

GATEWAY_URL = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8000").rstrip("/")
models = [m["id"] for m in httpx.get(f"{GATEWAY_URL}/v1/models", timeout=30).json()["data"]]
MODEL = os.environ.get("GATEWAY_MODEL", models[0])
PROMPT = "The capital of France is"
TOKENS = 16
print(f"{GATEWAY_URL}: models {models}; touring {MODEL!r}")"""),
    ("markdown", "## OpenAI: the `openai` SDK"),
    ("code", """from openai import OpenAI

oai = OpenAI(base_url=f"{GATEWAY_URL}/v1", api_key=os.environ.get("GATEWAY_API_KEY", "unused"))
chat = oai.chat.completions.create(
    model=MODEL, max_tokens=24, temperature=0,
    messages=[{"role": "user", "content": "What is the capital of France?"}])
print("chat:", chat.choices[0].message.content)
stream = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                stream=True)
print("streamed:", "".join(chunk.choices[0].text for chunk in stream if chunk.choices))"""),
    ("markdown", """## LMTP: LMQL's own client

`lmql.model(..., endpoint=...)` speaks LMTP over a websocket, the same as `lmql serve-model`.
LMQL tokenizes on the client, so it needs the model's tokenizer; the gateway lists the model's
directory under `root` only when `expose_model_paths` is set. Here the embedded model's
directory is found on this machine, which is true when the gateway runs on it."""),
    ("code", """import lmql

from engines.kit.embedded import EMBEDDED_MODEL_NAME, local_model_dir

tokenizer_dir = local_model_dir(f"embedded:{EMBEDDED_MODEL_NAME}")
lmql_model = lmql.model(MODEL, endpoint=GATEWAY_URL.removeprefix("http://"), tokenizer=tokenizer_dir)
result = await lmql.run(f'argmax "{PROMPT}[ANSWER]" where len(TOKENS(ANSWER)) < 8', model=lmql_model)
print("LMQL ANSWER:", repr(result.variables["ANSWER"]))"""),
    ("markdown", "## TGI: `text-generation` and `huggingface_hub`"),
    ("code", """import text_generation
from huggingface_hub import InferenceClient

tgi = text_generation.Client(GATEWAY_URL, timeout=120)
print("text-generation:", repr(tgi.generate(PROMPT, max_new_tokens=TOKENS).generated_text))
hub = InferenceClient(base_url=GATEWAY_URL, timeout=120)
print("huggingface_hub:", repr(hub.text_generation(PROMPT, max_new_tokens=TOKENS)))"""),
    ("markdown", "## SageMaker LMI and MindIE (`/v2/models/{model}/generate_stream`, SSE)"),
    ("code", """lmi = httpx.post(f"{GATEWAY_URL}/invocations", params={"model_name": MODEL}, timeout=120,
                 json={"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS}})
print("LMI:", lmi.status_code, lmi.json())

text = ""
with httpx.stream("POST", f"{GATEWAY_URL}/v2/models/{MODEL}/generate_stream", timeout=120,
                  json={"text_input": PROMPT, "parameters": {"max_new_tokens": TOKENS}}) as r:
    for line in r.iter_lines():
        if line.startswith("data:"):
            text += json.loads(line[5:])["text_output"]
print("MindIE SSE:", repr(text))"""),
    ("markdown", """## Every path, timed

The same greedy request (`max_tokens` 32, EOS ignored so every answer has 32 tokens), 8 times
on each path, one after another: latency per request and tokens/s per request. With one
engine behind them all, the paths differ only by protocol translation and encoding."""),
    ("code", """import statistics

N, MAX = 8, 32


def openai_path():
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX, temperature=0,
                               extra_body={"ignore_eos": True})
    return r.usage.completion_tokens


def tgi_path():
    r = tgi.generate(PROMPT, max_new_tokens=MAX)  # the client always asks for details
    return r.details.generated_tokens


def lmi_path():
    r = httpx.post(f"{GATEWAY_URL}/invocations", params={"model_name": MODEL}, timeout=120,
                   json={"inputs": PROMPT, "parameters": {"max_new_tokens": MAX,
                                                          "ignore_eos": True,
                                                          "details": True}})
    return r.json()["details"]["generated_tokens"]


def mindie_path():
    r = httpx.post(f"{GATEWAY_URL}/v2/models/{MODEL}/generate", timeout=120,
                   json={"text_input": PROMPT, "parameters": {"max_new_tokens": MAX,
                                                              "ignore_eos": True,
                                                              "details": True}})
    return r.json()["details"]["generated_tokens"]


# LMTP prompts are token ids (LMQL tokenizes on the client): tokenize once, outside the timing.
ids = httpx.post(f"{GATEWAY_URL}/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]


async def _lmtp_once():
    import websockets

    async with websockets.connect(GATEWAY_URL.replace("http", "ws", 1) + "/lmtp") as ws:
        await ws.send("GENERATE " + json.dumps({"model": MODEL, "prompt": ids, "stream_id": 1,
                                                "max_tokens": MAX, "temperature": 0}))
        tokens = 0
        while True:
            _, _, body = (await ws.recv()).partition(" ")
            items = json.loads(body)
            tokens += sum(1 for i in items if "token" in i)
            if any(i.get("finish_reason") or "error" in i for i in items):
                return tokens


paths = {"OpenAI": openai_path, "TGI": tgi_path, "LMI": lmi_path, "MindIE": mindie_path}
timings = {name: [] for name in [*paths, "LMTP"]}
for name, call in paths.items():
    for _ in range(N):
        t0 = time.perf_counter()
        tokens = call()
        timings[name].append((time.perf_counter() - t0, tokens))
for _ in range(N):  # LMTP is async (a websocket), awaited here in the notebook's own loop
    t0 = time.perf_counter()
    tokens = await _lmtp_once()
    timings["LMTP"].append((time.perf_counter() - t0, tokens))

print(f"{'path':8} {'median s':>9} {'tokens':>7} {'median tok/s':>13}")
for name, rows in timings.items():
    lat = statistics.median(s for s, _ in rows)
    tps = statistics.median(t / s for s, t in rows)
    print(f"{name:8} {lat:9.3f} {statistics.median(t for _, t in rows):7.0f} {tps:13.1f}")"""),
    ("code", """import matplotlib.pyplot as plt

names = list(timings)
fig, (ax_lat, ax_tps) = plt.subplots(1, 2, figsize=(11, 3.8))
ax_lat.boxplot([[s for s, _ in timings[n]] for n in names], tick_labels=names)
ax_lat.set_title(f"Latency per request ({MAX} tokens)")
ax_lat.set_ylabel("s")
ax_tps.bar(names, [statistics.median(t / s for s, t in timings[n]) for n in names])
ax_tps.set_title("Median tokens/s per request")
ax_tps.set_ylabel("tok/s")
fig.suptitle(f"{MODEL} at {GATEWAY_URL}, {N} sequential requests per path")
fig.tight_layout()
plt.show()"""),
    ("markdown", """Reading it: requests run one at a time, so latency is roughly 32 decode steps plus a
prefill, and the paths should sit within a few percent of each other. A path that is
consistently slower costs something in its own translation. `bench/protocols.py` measures the
same thing under concurrency, over several rounds."""),
]


def main() -> None:
    print(write_notebook(CELLS, "multi_protocol_tour.ipynb"))


if __name__ == "__main__":
    main()

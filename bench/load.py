"""The load generator: ``vllm bench serve`` against a server, at the priority it was granted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# The load generator shares the box with the server it measures. At normal priority, under a
# hog, it was starved itself on the fast layout: 1.0-4.1 s of run-queue wait per 5 s run for
# 0.2 s of CPU, event-loop stalls up to 1.2 s, while the replica, from Serve's direct-ingress
# entry to the first token, took 80-150 ms (docs/results/benchmarks-2026-12-07.md, "The load generator"). That
# is the client's wait, not the server's. At real-time priority (SCHED_FIFO) its wake-ups run
# at once, the nearest a one-box bench gets to a client on its own machine; a client like it
# used about 0.4 s of CPU per 5 s run, and every target gets the same.
CLIENT_PRIORITIES = ("realtime", "normal")
_CLIENT_FIFO_PRIORITY = 10


def realtime(flags: int = 0) -> None:
    """This process at the load generator's real-time priority (also a ``preexec_fn``)."""
    os.sched_setscheduler(0, os.SCHED_FIFO | flags, os.sched_param(_CLIENT_FIFO_PRIORITY))


def client_priority(wanted: str) -> str:
    """``wanted`` if this process may give the load generator that priority, else ``normal``
    (real-time needs root or CAP_SYS_NICE), with a warning: what each row records."""
    if wanted == "normal":
        return wanted
    try:
        subprocess.run([sys.executable, "-c", "pass"], preexec_fn=realtime, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"load generator at normal priority: real-time refused ({exc})", file=sys.stderr)
        return "normal"
    return wanted


def realtime_client(wanted: str) -> str:
    """Run this process's calling thread (the clients) at the priority the load generator gets;
    children it starts later (``ray stop``) return to normal priority. Returns what it got."""
    got = client_priority(wanted)  # says so where real-time is refused
    if got == "realtime":
        realtime(os.SCHED_RESET_ON_FORK)
    return got


def run_load(port: int, model: str, model_dir: str, concurrency: int, prompts: int,
           backend: str, client: str = "normal", extra: tuple[str, ...] = ()) -> dict:
    """``extra``: more ``vllm bench serve`` arguments (``--lora-modules ...``)."""
    out = Path(tempfile.mkdtemp(prefix="compare-"))
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    cmd = [
        sys.executable, str(ROOT / "bench" / "vllm_cli.py"), "bench", "serve",
        "--backend", backend, "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", endpoint, "--model", model, "--tokenizer", model_dir,
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--num-warmups", str(max(4, concurrency)), "--ignore-eos", "--temperature", "0",
        "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(out), "--result-filename", "r.json", *extra,
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   preexec_fn=realtime if client == "realtime" else None)
    return json.loads((out / "r.json").read_text())

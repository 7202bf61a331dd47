"""Gateway vs bare vLLM, same model, same machine, same load, one run.

Serves the embedded model through (a) vLLM's own OpenAI server and (b) the gateway
(Ray Serve ingress + vLLM deployment), one after the other so they never share the CPU, drives
each with ``vllm bench serve`` (random 128-in / 64-out, 64 prompts, concurrency 16, ignore_eos,
greedy), and prints ratios. Usage::

    python bench/compare.py [--num-prompts 64] [--concurrency 16] [--backend openai|openai-chat]

Results land in ``bench/results/`` (JSON per target and ``summary.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.config import ModelConfig  # noqa: E402
from engines.embedded import EMBEDDED_MODEL_NAME, prepare_embedded_model  # noqa: E402
from engines.vllm.args import engine_args as vllm_engine_args  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BARE_PORT, GATEWAY_PORT = 8100, 8000


def _bin(name: str) -> str:
    """A console script of this interpreter's environment (a .venv need not be on PATH)."""
    return str(Path(sys.executable).parent / name)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _bench(label: str, port: int, model_dir: str, args) -> dict:
    filename = f"{label}.json"
    endpoint = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    cmd = [
        sys.executable, str(ROOT / "bench" / "vllm_cli.py"), "bench", "serve",
        "--backend", args.backend, "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", endpoint, "--model", EMBEDDED_MODEL_NAME, "--tokenizer", model_dir,
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64",
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--num-warmups", "4", "--ignore-eos", "--temperature", "0", "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(RESULTS), "--result-filename", filename,
    ]
    print(f"\n=== {label}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads((RESULTS / filename).read_text())


def _serve_bare(model_dir: str) -> subprocess.Popen:
    # Exactly the engine args the gateway's replica resolves for this machine.
    engine_args = vllm_engine_args(ModelConfig().engine_args)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", EMBEDDED_MODEL_NAME, "--host", "127.0.0.1",
           "--port", str(BARE_PORT)]
    for key, value in engine_args.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)


def _serve_gateway() -> subprocess.Popen:
    config = {
        "proxy_location": "EveryNode",
        "http_options": {"host": "127.0.0.1", "port": GATEWAY_PORT},
        "applications": [{
            "name": "gateway", "route_prefix": "/", "import_path": "gateway.app:build_app",
            "args": {"models": [{"name": EMBEDDED_MODEL_NAME}]},
        }],
    }
    path = Path(tempfile.mkdtemp()) / "bench_serve.json"
    path.write_text(json.dumps(config))
    env = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "gateway.proxy:middlewares",
           **os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([_bin("serve"), "run", str(path)], cwd=ROOT, env=env,
                            start_new_session=True)


def _row(name: str, bare: float, gateway: float, better_high: bool) -> str:
    ratio = gateway / bare if bare else float("nan")
    delta = (gateway - bare) / bare * 100 if bare else float("nan")
    note = f"{ratio:.3f}x" if better_high else f"{delta:+.1f}%"
    return f"| {name} | {bare:.2f} | {gateway:.2f} | {note} |"


def summarize(bare: dict, gateway: dict, args) -> str:
    lines = [
        f"Load: random 128-in/64-out, {args.num_prompts} prompts, concurrency {args.concurrency},"
        f" ignore_eos, temperature 0, backend `{args.backend}`.",
        "",
        "| metric | bare vLLM | gateway | gateway vs bare |",
        "|---|---|---|---|",
        _row("output throughput (tok/s)", bare["output_throughput"],
             gateway["output_throughput"], True),
        _row("request throughput (req/s)", bare["request_throughput"],
             gateway["request_throughput"], True),
    ]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("median", "p90", "p99"):
            key = f"{stat}_{metric}_ms"
            if key in bare and key in gateway:
                lines.append(_row(f"{stat} {metric.upper()} (ms)", bare[key], gateway[key], False))
    lines.append(f"\nFailed requests: bare {bare.get('failed', 0)}, gateway "
                 f"{gateway.get('failed', 0)}; generated tokens: bare {bare['total_output_tokens']}"
                 f", gateway {gateway['total_output_tokens']}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--backend", default="openai", choices=["openai", "openai-chat"])
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    model_dir = str(prepare_embedded_model())

    results = {}
    for label, start, port in (("bare-vllm", lambda: _serve_bare(model_dir), BARE_PORT),
                               ("gateway", _serve_gateway, GATEWAY_PORT)):
        proc = start()
        try:
            _wait_healthy(f"http://127.0.0.1:{port}", proc)
            results[label] = _bench(label, port, model_dir, args)
        finally:
            _stop(proc)
            if label == "gateway":
                subprocess.run([_bin("ray"), "stop", "--force"], capture_output=True)
    summary = summarize(results["bare-vllm"], results["gateway"], args)
    (RESULTS / "summary.md").write_text(summary + "\n")
    print("\n" + summary)


if __name__ == "__main__":
    main()

"""Gateway vs bare vLLM vs Ray Serve LLM: same model, same machine, same load, one run.

Each round starts every server in turn (the order rotates from round to round), drives it with
``vllm bench serve`` (random 128-in / 64-out, ignore_eos, greedy, warm-up requests excluded) at
each concurrency, and stops it, so two servers never share the CPU. Besides throughput, TTFT
and TPOT it reads the CPU time of each server's process tree and reports **CPU seconds per
1,000 output tokens outside the engine** (vLLM's EngineCore process), the figure of a serving
stack's overhead that does not depend on how fast the box's engine step is (``cputime.py``).

Two models: the embedded SmolLM2 (the README's default), and a tiny random-weight Llama (4
layers, hidden 256, made on the fly) on which the engine is nearly free, so the serving stack's
own cost dominates. ``--hog`` runs one busy process pinned to CPU 0 beside every server
(contention). Usage::

    python bench/compare.py [--models embedded,tiny] [--targets bare,gateway,serve-llm]
                            [--concurrency 1,16,64] [--rounds 3] [--hog]

Targets: ``bare``, ``gateway`` (the README's default layout: each model its own application,
HAProxy on the public port), ``gateway-one-app`` (engines inside the gateway's application),
``gateway-serve-proxy`` (the same with Serve's proxy actor on the port), ``gateway-over-ray``
(engine replicas streaming as Ray objects: ``engine_transport: ray``), ``gateway-colocated``
(``serve_config.colocated.yaml``'s layout), ``serve-llm`` (Ray Serve LLM), and the other
variants in ``STARTERS``. Results land in ``bench/results/``:
``compare.json`` (every measurement) and ``summary.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from math import nan
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cputime  # noqa: E402
from engines.embedded import EMBEDDED_MODEL_NAME, prepare_embedded_model  # noqa: E402
from engines.vllm.args import engine_args as vllm_engine_args  # noqa: E402
from gateway import serve_env  # noqa: E402
from gateway.model_routes import model_route  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PORTS = {"bare": 8100, "gateway": 8000, "serve-llm": 8200}  # every gateway-* target: 8000
TINY_NAME = "tiny-random-llama"
# The tiny model's positions stop at 512; the embedded model keeps the gateway's default.
TINY_OVERRIDES = {"max_model_len": 512}


def _bin(name: str) -> str:
    """A console script of this interpreter's environment (a .venv need not be on PATH)."""
    return str(Path(sys.executable).parent / name)


def _wait_ready(url: str, model: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    """Until the server lists ``model`` (every target serves ``/v1/models``; Ray Serve LLM has
    no ``/health`` on its ingress)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming ready")
        try:
            listed = httpx.get(f"{url}/v1/models", timeout=5)
            if listed.status_code == 200 and model in listed.text:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# The load generator shares the box with the server it measures. At normal priority, under a
# hog, it was starved itself on the fast layout: 1.0-4.1 s of run-queue wait per 5 s run for
# 0.2 s of CPU, event-loop stalls up to 1.2 s, while the replica, from Serve's direct-ingress
# entry to the first token, took 80-150 ms (docs/benchmarks.md, "The load generator"). That
# is the client's wait, not the server's. At real-time priority (SCHED_FIFO) its wake-ups run
# at once, the nearest a one-box bench gets to a client on its own machine; a client like it
# used about 0.4 s of CPU per 5 s run, and every target gets the same.
CLIENT_PRIORITIES = ("realtime", "normal")
_CLIENT_FIFO_PRIORITY = 10


def _realtime(flags: int = 0) -> None:
    """This process at the load generator's real-time priority (also a ``preexec_fn``)."""
    os.sched_setscheduler(0, os.SCHED_FIFO | flags, os.sched_param(_CLIENT_FIFO_PRIORITY))


def client_priority(wanted: str) -> str:
    """``wanted`` if this process may give the load generator that priority, else ``normal``
    (real-time needs root or CAP_SYS_NICE), with a warning: what each row records."""
    if wanted == "normal":
        return wanted
    try:
        subprocess.run([sys.executable, "-c", "pass"], preexec_fn=_realtime, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"load generator at normal priority: real-time refused ({exc})", file=sys.stderr)
        return "normal"
    return wanted


def realtime_client(wanted: str) -> str:
    """Run this process's calling thread (the clients) at the priority the load generator gets;
    children it starts later (``ray stop``) return to normal priority. Returns what it got."""
    got = client_priority(wanted)  # says so where real-time is refused
    if got == "realtime":
        _realtime(os.SCHED_RESET_ON_FORK)
    return got


def _bench(port: int, model: str, model_dir: str, concurrency: int, prompts: int,
           backend: str, client: str = "normal") -> dict:
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
        "--save-result", "--result-dir", str(out), "--result-filename", "r.json",
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   preexec_fn=_realtime if client == "realtime" else None)
    return json.loads((out / "r.json").read_text())


def _serve_bare(model: str, model_dir: str, overrides: dict) -> subprocess.Popen:
    # Exactly the engine args the gateway's replica resolves for this machine.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", model, "--host", "127.0.0.1", "--port", str(PORTS["bare"])]
    for key, value in vllm_engine_args(overrides).items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL)


def _ray_env(ingress: str | None = None, **extra: str) -> dict:
    # The gateway's own Ray environment (scripts/serve.sh's) for the public port's ``ingress``
    # (default: the README's), then the variant's settings.
    env = dict(os.environ)
    if ingress:
        env[serve_env.INGRESS_VAR] = ingress
    env = serve_env.apply(env)
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT), **extra}


def _serve_run(port: int, applications: list[dict], env: dict,
               root: Path = ROOT) -> subprocess.Popen:
    """``serve run`` of a config with ``applications`` on ``port`` (127.0.0.1), in its own
    process group (``_stop``), with the gateway's code from ``root``."""
    config = {"proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1", "port": port},
              "applications": applications}
    path = Path(tempfile.mkdtemp()) / "bench_serve.json"
    path.write_text(json.dumps(config))
    return subprocess.Popen([_bin("serve"), "run", str(path)], cwd=root, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL)


def _serve_gateway(model: str, model_dir: str, overrides: dict,
                   env: dict | None = None, colocated: bool = False,
                   transport: str = "channel", ingress: str | None = None) -> subprocess.Popen:
    # The README's path: `serve run` of a config; HAProxy on the public port unless ``ingress``
    # is "serve" (Serve's proxy actor).
    app = {"name": "gateway", "route_prefix": "/", "import_path": "gateway.app:build_app",
           "args": {"models": [{"name": model, "source": model_dir, "engine_args": overrides,
                                "colocated": colocated}],
                    "engine_transport": transport}}
    return _serve_run(PORTS["gateway"], [app], _ray_env(ingress, **(env or {})))


def _serve_model_apps(model: str, model_dir: str, overrides: dict, count: int = 1,
                      ingress: str | None = None, root: Path = ROOT) -> subprocess.Popen:
    """``serve_config.yaml``'s layout (the README's default): each model its own Serve
    application (``build_model_app`` at ``/model/<name>``), the gateway application naming
    them. ``count`` 2 adds a second copy of the model that idles
    (``serve_config.cluster.yaml``'s two models): what serving several costs the one in use."""
    models = [{"name": name, "source": model_dir, "engine_args": overrides}
              for name in (model, f"{model}-second")[:count]]
    apps = [{"name": f"model-{i}", "route_prefix": model_route(entry["name"]),
             "import_path": "gateway.app:build_model_app", "args": {"model": entry}}
            for i, entry in enumerate(models)]
    apps.append({"name": "gateway", "route_prefix": "/", "import_path": "gateway.app:build_app",
                 "args": {"models": [{**entry, "app": f"model-{i}"}
                                     for i, entry in enumerate(models)]}})
    return _serve_run(PORTS["gateway"], apps, _ray_env(ingress, PYTHONPATH=str(root)), root)


def _serve_before(model: str, model_dir: str, overrides: dict) -> subprocess.Popen:
    """The default layout with the gateway's code of another checkout (``BENCH_BEFORE_TREE``,
    e.g. a ``git worktree`` of an earlier commit): before vs after a change in one run."""
    tree = os.environ.get("BENCH_BEFORE_TREE")
    if not tree or not (Path(tree) / "gateway" / "app.py").is_file():
        raise SystemExit("gateway-before needs BENCH_BEFORE_TREE: a checkout of the gateway")
    return _serve_model_apps(model, model_dir, overrides, root=Path(tree))


def _serve_llm(model: str, model_dir: str, overrides: dict) -> subprocess.Popen:
    app = {"name": "llm", "route_prefix": "/", "import_path": "bench.serve_llm_app:build",
           "args": {"model_id": model, "model_dir": model_dir, "engine_args": overrides}}
    return _serve_run(PORTS["serve-llm"], [app],
                      _ray_env(RAY_OVERRIDE_RESOURCES=json.dumps({"CPU": 8})))


# Ray Serve settings tried on the gateway behind Serve's proxy (the env of the Ray instance
# `serve run` starts).
VARIANTS = {
    # User code on Serve's own event loop and the handle's router on the caller's loop: no
    # thread hop per ASGI message and per streamed item.
    "gateway-samethread": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                           "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"},
    # ... and calls between deployments (proxy -> ingress -> engine) over Serve's gRPC
    # transport, by value, instead of Ray actor tasks and object refs.
    "gateway-grpc": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                     "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
                     "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"},
    # Ray Serve's own bundle of the above (plus direct ingress, buffered request logs).
    "gateway-tput": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
}


def _eager(start: Callable[..., subprocess.Popen]) -> Callable[..., subprocess.Popen]:
    """``start`` with vLLM eager (``enforce_eager``: no torch.compile warm-up at start)."""
    return lambda model, model_dir, overrides: start(model, model_dir,
                                                     {**overrides, "enforce_eager": True})


_SERVE_PROXY = functools.partial(_serve_gateway, ingress="serve")
_HAPROXY = functools.partial(_serve_gateway, ingress="haproxy")
STARTERS = {"bare": _serve_bare, "serve-llm": _serve_llm,
            # The README's default: each model its own application, HAProxy on the port
            # sending requests that name it there.
            "gateway": _serve_model_apps,
            # The default layout with vLLM eager: no compile at start, slower steps
            # (docs/benchmarks.md, "vLLM eager vs compiled").
            "gateway-eager": _eager(_serve_model_apps),
            # The same from another checkout (BENCH_BEFORE_TREE): a change's before and after.
            "gateway-before": _serve_before,
            # Two models, each its own application (serve_config.cluster.yaml's layout).
            "gateway-two-apps": functools.partial(_serve_model_apps, count=2),
            # The default before models had applications of their own: engine deployments
            # inside the gateway's application, every token through its ingress replica.
            "gateway-one-app": _serve_gateway,
            # The same with Serve's proxy actor on the public port (LLM_GATEWAY_INGRESS=serve).
            "gateway-serve-proxy": functools.partial(_serve_model_apps, ingress="serve"),
            # The engine inside the ingress replica (ModelConfig.colocated): no hop between
            # the engine and the protocol encoders.
            "gateway-colocated": functools.partial(_serve_gateway, colocated=True),
            "gateway-colocated-serve-proxy": functools.partial(_SERVE_PROXY, colocated=True),
            "gateway-colocated-grpc": functools.partial(_SERVE_PROXY, colocated=True,
                                                        env=VARIANTS["gateway-grpc"]),
            # Engine replicas streaming to the ingress as Ray objects (engine_transport: ray,
            # the default layout before the engine channel).
            "gateway-over-ray": functools.partial(_serve_gateway, transport="ray"),
            "gateway-serve-proxy-over-ray": functools.partial(_SERVE_PROXY, transport="ray"),
            # Names of earlier runs (docs/benchmarks.md), HAProxy on the port whatever the
            # default: the same as gateway, gateway-over-ray and gateway-colocated now.
            "gateway-haproxy": _HAPROXY,
            "gateway-haproxy-over-ray": functools.partial(_HAPROXY, transport="ray"),
            "gateway-colocated-haproxy": functools.partial(_HAPROXY, colocated=True),
            **{name: functools.partial(_SERVE_PROXY, env=env) for name, env in VARIANTS.items()}}
PORTS.update({name: PORTS["gateway"] for name in STARTERS if name.startswith("gateway")})


def _hog() -> subprocess.Popen:
    """One busy process pinned to CPU 0 for the whole run: the same contention for every
    server."""
    return subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\n"
                             "while True:\n    pass"], start_new_session=True)


def _build_tiny(target: Path, tokenizer_dir: Path) -> Path:
    """A random-weight Llama the engine runs almost for free: 4 layers, hidden 256, head_dim 64
    (vLLM's CPU attention has no kernels for smaller heads), SmolLM2's vocabulary and tokenizer
    so prompts and outputs look like the embedded model's."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, target / name)
    return target


def _models(names: list[str]) -> list[tuple[str, str, dict]]:
    out = []
    embedded = str(prepare_embedded_model())
    for name in names:
        if name == "embedded":
            out.append((EMBEDDED_MODEL_NAME, embedded, {}))
        elif name == "tiny":
            out.append((TINY_NAME, str(_build_tiny(Path(tempfile.mkdtemp(prefix="tiny-")),
                                                   Path(embedded))), TINY_OVERRIDES))
        else:
            raise SystemExit(f"unknown model {name!r}: embedded or tiny")
    return out


def measure(args) -> list[dict]:
    rows: list[dict] = []
    for model, model_dir, overrides in _models(args.models):
        for rnd in range(args.rounds):
            order = args.targets[rnd % len(args.targets):] + args.targets[:rnd % len(args.targets)]
            for target in order:
                started = time.monotonic()
                proc = STARTERS[target](model, model_dir, overrides)
                try:
                    _wait_ready(f"http://127.0.0.1:{PORTS[target]}", model, proc)
                    ready_s = round(time.monotonic() - started, 1)  # start to serving
                    # What the server burns with no request at all (Ray's background, pollers):
                    # part of every per-token figure below, largest at c=1.
                    time.sleep(args.idle_s / 2)
                    before = cputime.snapshot(proc.pid)
                    time.sleep(args.idle_s)
                    idle = cputime.spent(before, cputime.snapshot(proc.pid))
                    idle = {f"idle_{k}": round(v / args.idle_s, 3) for k, v in idle.items()}
                    for conc in args.concurrency:
                        prompts = args.c1_prompts if conc == 1 else max(args.num_prompts, 2 * conc)
                        before = cputime.snapshot(proc.pid)
                        result = _bench(PORTS[target], model, model_dir, conc, prompts,
                                        args.backend, args.client)
                        after = cputime.snapshot(proc.pid)
                        cpu = cputime.spent(before, after)
                        cpu["cpu_s_by_process"] = cputime.spent_by_role(
                            before, after, cputime.labels(proc.pid))
                        row = {"model": model, "target": target, "round": rnd,
                               "ready_s": ready_s,
                               "concurrency": conc, "prompts": prompts, "client": args.client,
                               **cpu, **idle,
                               **{k: v for k, v in result.items()
                                  if isinstance(v, (int, float))}}
                        rows.append(row)
                        print(json.dumps({k: row[k] for k in (
                            "model", "target", "round", "ready_s", "concurrency",
                            "output_throughput",
                            "median_ttft_ms", "median_tpot_ms", "other_cpu_s", "engine_cpu_s",
                            "total_output_tokens", "cpu_s_by_process")}), flush=True)
                finally:
                    tree = cputime.snapshot(proc.pid)
                    _stop(proc)
                    if target != "bare":
                        subprocess.run([_bin("ray"), "stop", "--force"], capture_output=True)
                    # `ray stop --force` kills replicas, and a killed replica's vLLM engine
                    # processes can outlive it; none may run into the next server's turn.
                    cputime.kill_leftovers(tree)
    return rows


def _mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def _per_1k(rows: list[dict], key: str) -> float:
    return 1000 * sum(r[key] for r in rows) / sum(r["total_output_tokens"] for r in rows)


def summarize(rows: list[dict], args) -> str:
    lines = [f"Load: random 128-in/64-out, ignore_eos, temperature 0, backend `{args.backend}`,"
             f" {1 + max(r['round'] for r in rows)} rounds (server order rotating),"
             " warm-ups excluded"
             f"{', one busy process pinned to CPU 0 throughout' if args.hog else ''}"
             f", load generator at {_clients(rows)} priority.", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += [f"### {model}", "",
                  "| c | server | output tok/s (rounds) | mean | vs bare | TTFT p50 ms | "
                  "TPOT p50 ms | CPU s / 1k tok outside engine | engine CPU s / 1k tok | "
                  "idle CPU s/s outside engine |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        mine = [r for r in rows if r["model"] == model]
        for conc in sorted({r["concurrency"] for r in mine}):
            picked = {t: [r for r in mine if r["target"] == t and r["concurrency"] == conc]
                      for t in dict.fromkeys(r["target"] for r in mine)}
            bare = picked.get("bare")
            for target, got in picked.items():
                if not got:
                    continue
                tput = _mean(got, "output_throughput")
                ratio = f"{tput / _mean(bare, 'output_throughput'):.3f}x" if bare else "-"
                ttft, tpot = _mean(got, "median_ttft_ms"), _mean(got, "median_tpot_ms")
                if bare and target != "bare":
                    ttft_s = f"{ttft:.1f} ({ttft - _mean(bare, 'median_ttft_ms'):+.1f})"
                    tpot_s = f"{tpot:.2f} ({tpot - _mean(bare, 'median_tpot_ms'):+.2f})"
                else:
                    ttft_s, tpot_s = f"{ttft:.1f}", f"{tpot:.2f}"
                rounds = ", ".join(f"{r['output_throughput']:.1f}" for r in got)
                lines.append(f"| {conc} | {target} | {rounds} | {tput:.1f} | {ratio} | {ttft_s} "
                             f"| {tpot_s} | {_per_1k(got, 'other_cpu_s'):.2f} | "
                             f"{_per_1k(got, 'engine_cpu_s'):.2f} | "
                             f"{statistics.fmean(r.get('idle_other_cpu_s', nan) for r in got):.2f} |")
        lines.append("")
    failed = sum(r.get("failed", 0) for r in rows)
    lines.append(f"Failed requests: {failed}. Machine: {_machine()}.")
    return "\n".join(lines)


def _clients(rows: list[dict]) -> str:
    # Rows from before the option ran the load generator at normal priority.
    return " / ".join(sorted({r.get("client", "normal") for r in rows}))


def _machine() -> str:
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    simd = "AVX-512 + avx512_bf16" if "avx512_bf16" in flags else (
        "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2")
    if "amx_bf16" in flags:  # Intel's matrix units: bf16 steps much faster than AVX-512 alone
        simd += " + AMX"
    dtype = vllm_engine_args({})["dtype"]
    return (f"{os.cpu_count()} CPUs ({platform.machine()}, {simd}), engine dtype {dtype} "
            f"({'checkpoint dtype' if dtype == 'auto' else 'no native bf16'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--models", type=split, default=["embedded", "tiny"])
    parser.add_argument("--targets", type=split, default=["bare", "gateway", "serve-llm"])
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="prompts per run at c > 1 (at least 2 x c)")
    parser.add_argument("--c1-prompts", type=int, default=16, help="prompts per run at c = 1")
    parser.add_argument("--backend", default="openai", choices=["openai", "openai-chat"])
    parser.add_argument("--hog", action="store_true")
    parser.add_argument("--client-priority", dest="client", choices=CLIENT_PRIORITIES,
                        default="realtime",
                        help="scheduling of the load generator (realtime: SCHED_FIFO, if allowed)")
    parser.add_argument("--idle-s", type=float, default=10,
                        help="seconds of idle CPU measured per server before its load")
    parser.add_argument("--summarize", type=Path, metavar="COMPARE_JSON",
                        help="only write the summary of an earlier run's compare.json")
    args = parser.parse_args()
    if args.summarize:
        print(summarize(json.loads(args.summarize.read_text()), args))
        return
    unknown = set(args.targets) - set(STARTERS)
    if unknown:
        raise SystemExit(f"unknown targets {sorted(unknown)}: {sorted(STARTERS)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.client = client_priority(args.client)
    hog = _hog() if args.hog else None
    try:
        rows = measure(args)
    finally:
        if hog:
            _stop(hog)
    (RESULTS / "compare.json").write_text(json.dumps(rows, indent=1))
    summary = summarize(rows, args)
    (RESULTS / "summary.md").write_text(summary + "\n")
    print("\n" + summary)


if __name__ == "__main__":
    main()

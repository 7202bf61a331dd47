"""The servers the benches start and stop: bare vLLM, the gateway's layouts, Ray Serve LLM, and
the models they serve (the embedded SmolLM2, a tiny random-weight Llama). Each starter runs its
server in its own process group (``stop``) on the port ``PORTS`` names."""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cputime  # noqa: E402
from engines.kit.embedded import EMBEDDED_MODEL_NAME, prepare_embedded_model  # noqa: E402
from engines.vllm.args import engine_args as vllm_engine_args  # noqa: E402
from gateway import serve_env  # noqa: E402
from gateway.model_routes import model_route  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PORTS = {"bare": 8100, "gateway": 8000, "serve-llm": 8200}  # every gateway-* target: 8000
TINY_NAME = "tiny-random-llama"
# The tiny model's positions stop at 512; the embedded model keeps the gateway's default.
TINY_OVERRIDES = {"max_model_len": 512}
# The application of the idle second model that ``gateway-two-apps`` adds (``serve_model_apps``).
SECOND_APP = "model-1"


def venv_bin(name: str) -> str:
    """A console script of this interpreter's environment (a .venv need not be on PATH)."""
    return str(Path(sys.executable).parent / name)


def wait_ready(url: str, model: str, proc: subprocess.Popen, timeout: float = 900,
               headers: dict | None = None) -> None:
    """Until the server lists ``model`` (every target serves ``/v1/models``; Ray Serve LLM has
    no ``/health`` on its ingress); ``headers``: an API key, where the gateway has keys."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming ready")
        try:
            listed = httpx.get(f"{url}/v1/models", timeout=5, headers=headers)
            if listed.status_code == 200 and model in listed.text:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_tree(proc: subprocess.Popen, target: str) -> None:
    """Stop a server a starter began, and everything it left: Ray for every target but bare
    (``ray stop --force`` kills the replicas), then whatever of its tree still runs, since a
    killed replica's vLLM engine processes can outlive it and none may run into the next
    server's turn."""
    tree = cputime.snapshot(proc.pid)
    stop(proc)
    if target != "bare":
        subprocess.run([venv_bin("ray"), "stop", "--force"], capture_output=True)
    cputime.kill_leftovers(tree)


def serve_bare(model: str, model_dir: str, overrides: dict) -> subprocess.Popen:
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


def serve_run(port: int, applications: list[dict], env: dict,
               root: Path = ROOT) -> subprocess.Popen:
    """``serve run`` of a config with ``applications`` on ``port`` (127.0.0.1), in its own
    process group (``stop``), with the gateway's code from ``root``."""
    config = {"proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1", "port": port},
              "applications": applications}
    path = Path(tempfile.mkdtemp()) / "bench_serve.json"
    path.write_text(json.dumps(config))
    return subprocess.Popen([venv_bin("serve"), "run", str(path)], cwd=root, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL)


def serve_gateway(model: str, model_dir: str, overrides: dict,
                   env: dict | None = None, colocated: bool = False,
                   transport: str = "channel", ingress: str | None = None) -> subprocess.Popen:
    # The README's path: `serve run` of a config; HAProxy on the public port unless ``ingress``
    # is "serve" (Serve's proxy actor).
    app = {"name": "gateway", "route_prefix": "/", "import_path": "gateway.app:build_app",
           "args": {"models": [{"name": model, "source": model_dir, "engine_args": overrides,
                                "colocated": colocated}],
                    "engine_transport": transport}}
    return serve_run(PORTS["gateway"], [app], _ray_env(ingress, **(env or {})))


def serve_model_apps(model: str, model_dir: str, overrides: dict, count: int = 1,
                      ingress: str | None = None, root: Path = ROOT,
                      env: dict | None = None, options: dict | None = None) -> subprocess.Popen:
    """``serve_config.yaml``'s layout (the README's default): each model its own Serve
    application (``build_model_app`` at ``/model/<name>``), the gateway application naming
    them. ``count`` 2 adds a second copy of the model that idles
    (``serve_config.cluster.yaml``'s two models): what serving several costs the one in use.
    ``options``: more of the model entry (``num_replicas``, ``routing``, ...)."""
    models = [{"name": name, "source": model_dir, "engine_args": overrides, **(options or {})}
              for name in (model, f"{model}-second")[:count]]
    names = ("model-0", SECOND_APP)
    apps = [{"name": names[i], "route_prefix": model_route(entry["name"]),
             "import_path": "gateway.app:build_model_app", "args": {"model": entry}}
            for i, entry in enumerate(models)]
    apps.append({"name": "gateway", "route_prefix": "/", "import_path": "gateway.app:build_app",
                 "args": {"models": [{**entry, "app": names[i]}
                                     for i, entry in enumerate(models)]}})
    return serve_run(PORTS["gateway"], apps,
                     _ray_env(ingress, PYTHONPATH=str(root), **(env or {})), root)


def set_second_app(proc: subprocess.Popen, present: bool, settle_s: float = 40,
                   timeout_s: float = 300) -> None:
    """Deploy or delete the idle second model's application of a running ``gateway-two-apps``
    server (``proc``: its ``serve run``), through Serve's own CLI with the server's config less
    or plus that application. Serve leaves the applications whose config did not change as
    they run: the measured model's replica and engine, and the gateway's ingress. Returns
    ``settle_s`` after the application's processes are gone, or after it runs: past a new
    engine's start-up tail (its monitor's first 30 s) and HAProxy's reload. Already as
    wanted: returns at once, with nothing deployed and no settling (a visit of several loads)."""
    if _second_app_is(proc, present, _app_status(SECOND_APP)):
        return
    started_with = Path(proc.args[-1])  # serve_run's config
    config = json.loads(started_with.read_text())
    if not present:
        config["applications"] = [a for a in config["applications"] if a["name"] != SECOND_APP]
    path = started_with.with_name(f"second-{'present' if present else 'absent'}.json")
    path.write_text(json.dumps(config))
    _serve_cli("deploy", str(path))
    deadline, status = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        # Serve reports RUNNING once the replica's constructor, the engine's start included,
        # has returned: no process title needs to be read (vLLM's are sometimes missing).
        status = _app_status(SECOND_APP)
        if _second_app_is(proc, present, status):
            time.sleep(settle_s)
            return
        time.sleep(2)
    raise TimeoutError(f"{SECOND_APP} not {'running' if present else 'gone'} after {timeout_s} s "
                       f"(Serve's status of it: {status})")


def _second_app_is(proc: subprocess.Popen, present: bool, status: str | None) -> bool:
    """The second application runs (Serve's ``status``), or none of its processes is left."""
    if present:
        return status == "RUNNING"
    return not any(role.endswith(f" @{SECOND_APP}")
                   for role in cputime.labels(proc.pid, apart=(SECOND_APP,)).values())


def _app_status(app: str) -> str | None:
    """A Serve application's status as ``serve status`` reports it (None: not deployed)."""
    out = re.sub(r"\x1b\[[0-9;]*m", "", _serve_cli("status", check=False))  # no colours
    apps = (yaml.safe_load(out) or {}).get("applications") or {}
    return (apps.get(app) or {}).get("status")


def _serve_cli(*args: str, check: bool = True) -> str:
    """Serve's CLI on this node's running cluster, as an operator runs it (scripts/serve_cli.sh:
    the project's environment, Ray's token when the cluster has one); its output."""
    return subprocess.run(["bash", str(ROOT / "scripts" / "serve_cli.sh"), *args], check=check,
                          capture_output=True, text=True).stdout


def serve_before(model: str, model_dir: str, overrides: dict) -> subprocess.Popen:
    """The default layout with the gateway's code of another checkout (``BENCH_BEFORE_TREE``,
    e.g. a ``git worktree`` of an earlier commit): before vs after a change in one run."""
    tree = os.environ.get("BENCH_BEFORE_TREE")
    if not tree or not (Path(tree) / "gateway" / "app.py").is_file():
        raise SystemExit("gateway-before needs BENCH_BEFORE_TREE: a checkout of the gateway")
    return serve_model_apps(model, model_dir, overrides, root=Path(tree))


def serve_llm(model: str, model_dir: str, overrides: dict, replicas: int = 1,
              router: str | None = None, direct: bool = True) -> subprocess.Popen:
    """Ray Serve LLM as its users run it now (``direct``): direct streaming behind Serve's own
    HAProxy (its binary, its buffer size), ``router`` "prefix" for its prefix-aware router;
    ``direct`` False: its path before Ray 2.56 (an OpenAI ingress deployment in front of the
    LLM servers). ``place_peer`` gives it the gateway's CPU placement once it is up."""
    from gateway.edge.haproxy_errors import real_binary

    app = {"name": "llm", "route_prefix": "/", "import_path": "bench.serve_llm_app:build",
           "args": {"model_id": model, "model_dir": model_dir, "engine_args": overrides,
                    "num_replicas": replicas, "router": router}}
    env = _ray_env(RAY_OVERRIDE_RESOURCES=json.dumps({"CPU": 8}))
    env["RAY_SERVE_HAPROXY_BINARY_PATH"] = real_binary()
    env.pop("RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE", None)
    if direct:
        env["RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING"] = "1"
    return serve_run(PORTS["serve-llm"], [app], env)


_PLACE = """
import json, ray
ray.init(address="auto", log_to_driver=False)
from engines.kit.placement import place
print(json.dumps(ray.get(ray.remote(num_cpus=0)(place).remote())))
"""


def place_peer(target: str) -> dict | None:
    """The gateway's CPU placement (``engines.kit.placement.place``: every serving process of the
    node off the cores vLLM's workers pinned) applied once to a peer that is up, from a task in
    its Ray instance; what it did. The gateway's own replicas place the node themselves."""
    if not target.startswith("serve-llm"):
        return None
    done = subprocess.run([sys.executable, "-c", _PLACE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        print(f"placement of {target} failed: {done.stderr[-800:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def serve_ready(target: str, model: str, proc: subprocess.Popen) -> dict | None:
    """Wait until ``target`` serves ``model``; then place a peer as the gateway places itself.
    Returns what the placement did (None for the gateway, which places itself)."""
    wait_ready(f"http://127.0.0.1:{PORTS[target]}", model, proc)
    return place_peer(target)


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


_SERVE_PROXY = functools.partial(serve_gateway, ingress="serve")
_HAPROXY = functools.partial(serve_gateway, ingress="haproxy")
STARTERS = {"bare": serve_bare,
            # Ray Serve LLM: direct streaming behind HAProxy (its users' path since 2.56), and
            # its path before (an OpenAI ingress deployment in front of the LLM servers).
            "serve-llm": serve_llm, "serve-llm-classic": functools.partial(serve_llm, direct=False),
            # The README's default: each model its own application, HAProxy on the port
            # sending requests that name it there.
            "gateway": serve_model_apps,
            # The default layout with vLLM eager: no compile at start, slower steps
            # (docs/results/benchmarks-2026-12-07.md, "vLLM eager vs compiled").
            "gateway-eager": _eager(serve_model_apps),
            # The same from another checkout (BENCH_BEFORE_TREE): a change's before and after.
            "gateway-before": serve_before,
            # The default with the serving stack free to run on the engine worker's cores
            # (engines/kit/placement.py off).
            "gateway-unplaced": functools.partial(serve_model_apps,
                                                  env={"LLM_GATEWAY_PLACEMENT": "off"}),
            # Two models, each its own application (serve_config.cluster.yaml's layout).
            "gateway-two-apps": functools.partial(serve_model_apps, count=2),
            # The default before models had applications of their own: engine deployments
            # inside the gateway's application, every token through its ingress replica.
            "gateway-one-app": serve_gateway,
            # The same with Serve's proxy actor on the public port (LLM_GATEWAY_INGRESS=serve).
            "gateway-serve-proxy": functools.partial(serve_model_apps, ingress="serve"),
            # The engine inside the ingress replica (ModelConfig.colocated): no hop between
            # the engine and the protocol encoders.
            "gateway-colocated": functools.partial(serve_gateway, colocated=True),
            "gateway-colocated-serve-proxy": functools.partial(_SERVE_PROXY, colocated=True),
            "gateway-colocated-grpc": functools.partial(_SERVE_PROXY, colocated=True,
                                                        env=VARIANTS["gateway-grpc"]),
            # Engine replicas streaming to the ingress as Ray objects (engine_transport: ray,
            # the default layout before the engine channel).
            "gateway-over-ray": functools.partial(serve_gateway, transport="ray"),
            "gateway-serve-proxy-over-ray": functools.partial(_SERVE_PROXY, transport="ray"),
            # Names of earlier runs (docs/results/benchmarks-2026-12-07.md), HAProxy on the port whatever the
            # default: the same as gateway, gateway-over-ray and gateway-colocated now.
            "gateway-haproxy": _HAPROXY,
            "gateway-haproxy-over-ray": functools.partial(_HAPROXY, transport="ray"),
            "gateway-colocated-haproxy": functools.partial(_HAPROXY, colocated=True),
            **{name: functools.partial(_SERVE_PROXY, env=env) for name, env in VARIANTS.items()}}
PORTS.update({name: PORTS["gateway"] for name in STARTERS if name.startswith("gateway")})
PORTS.update({name: PORTS["serve-llm"] for name in STARTERS if name.startswith("serve-llm")})


def start_hog() -> subprocess.Popen:
    """One busy process pinned to CPU 0 for the whole run: the same contention for every
    server."""
    return subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\n"
                             "while True:\n    pass"], start_new_session=True)


def build_tiny(target: Path, tokenizer_dir: Path, max_positions: int = 512) -> Path:
    """A random-weight Llama the engine runs almost for free: 4 layers, hidden 256, head_dim 64
    (vLLM's CPU attention has no kernels for smaller heads), SmolLM2's vocabulary and tokenizer
    so prompts and outputs look like the embedded model's; ``max_positions`` long prompts at
    most (the routing bench's conversations need more than 512)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, target / name)
    return target


def models(names: list[str]) -> list[tuple[str, str, dict]]:
    out = []
    embedded = str(prepare_embedded_model())
    for name in names:
        if name == "embedded":
            out.append((EMBEDDED_MODEL_NAME, embedded, {}))
        elif name == "tiny":
            out.append((TINY_NAME, str(build_tiny(Path(tempfile.mkdtemp(prefix="tiny-")),
                                                   Path(embedded))), TINY_OVERRIDES))
        else:
            raise SystemExit(f"unknown model {name!r}: embedded or tiny")
    return out


def write_results(name: str, args: object, rows: list[dict], report: str) -> Path:
    """``bench/results/<name>-<time>.{json,md}``: the rows with the run's arguments, and the
    report (printed too)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}-{time.strftime('%Y-%m-%d-%H%M%S')}"
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(report)
    print(report)
    return out


def machine() -> str:
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

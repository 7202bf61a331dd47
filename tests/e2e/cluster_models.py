"""Run as a program (``python -m tests.e2e.cluster_models``) by ``test_cluster_e2e.py``: a Ray
cluster of a head and a worker node on this machine (``ray.cluster_utils.Cluster``, the custom
resources ``scripts/ray_node.sh`` gives: the head ``llm_gateway_cpu_engine``, the worker
``pipeline_stage``), Serve deployed with the ``serve deploy`` CLI from a config laid out like
``serve_config.cluster.yaml`` (each model its own application, the gateway naming them), two tiny
random checkpoints through the pipeline engine (one autoscaled 1-2 on the head, one with two
fixed replicas and its stages on the worker). It requests on every protocol, drives a burst to
watch the autoscaler, then deploys the config without the second model while a client keeps
asking the first. Prints one ``RESULT`` JSON line; a subprocess so its Ray cluster never meets
the test session's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

from gateway.model_routes import engine_deployment
from gateway.serve_env import free_port
from tests.readme_cluster import on_this_machine, readme_cluster_commands

A, B = "tiny-a", "tiny-b"
APP_A, APP_B = "model-tiny-a", "model-tiny-b"
MODEL_OF_APP = {APP_A: A, APP_B: B}
PROMPT = "The capital of France is"
TOKENS = 8
README = readme_cluster_commands()  # deployed and checked with the README's own commands



def _serve_config(http_port: int, a_dir: Path, b_dir: Path, with_b: bool) -> dict:
    stage = {"stage_num_cpus": 0.1, "max_sequences": 4}
    model_a = {"name": A, "engine": "pipeline", "source": str(a_dir), "num_cpus": 0.1,
               "resources": {"llm_gateway_cpu_engine": 0.01},
               "autoscaling": {"min_replicas": 1, "max_replicas": 2,
                               "target_ongoing_requests": 1, "look_back_period_s": 2,
                               "upscale_delay_s": 1, "downscale_delay_s": 4},
               "engine_args": {"num_stages": 1, **stage}}
    model_b = {"name": B, "engine": "pipeline", "source": str(b_dir), "num_cpus": 0.1,
               "num_replicas": 2,
               "engine_args": {"num_stages": 2, **stage,
                               "stage_resources": [{"pipeline_stage": 0.01}] * 2}}
    models = [(APP_A, model_a)] + ([(APP_B, model_b)] if with_b else [])
    apps = [{"name": app, "route_prefix": f"/model/{args['name']}",
             "import_path": "gateway.app:build_model_app", "args": {"model": args}}
            for app, args in models]
    apps.append({"name": "gateway", "route_prefix": "/", "import_path": "gateway.app:build_app",
                 "args": {"ingress_num_cpus": 0.1, "tgi_model": A,
                          "models": [{**args, "app": app} for app, args in models]}})
    return {"proxy_location": "HeadOnly",
            "http_options": {"host": "127.0.0.1", "port": http_port},
            "applications": apps}


def _on_head(command: str, dashboard: str, serve_config: Path | None = None) -> str:
    """One of the README's commands for the head node (``tests.readme_cluster``), run here
    against this cluster's dashboard with this interpreter's environment; its output."""
    env = {**os.environ, "RAY_DASHBOARD_ADDRESS": dashboard, "PYTHON": sys.executable}
    done = subprocess.run(on_this_machine(command, serve_config), capture_output=True,
                          text=True, timeout=120, env=env)
    if done.returncode:
        raise RuntimeError(f"{command!r} failed: {done.stderr[-3000:]}")
    return done.stdout


def _deploy(config: dict, path: Path, dashboard: str) -> None:
    path.write_text(yaml.safe_dump(config))
    _on_head(README.deploy, dashboard, path)


def _readme_status(dashboard: str) -> dict[str, str]:
    """Each application's status as the README's status command prints it."""
    apps = yaml.safe_load(_on_head(README.status, dashboard))["applications"]
    return {name: app["status"] for name, app in apps.items()}


def _wait(condition, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception:  # not up yet: connection refused, application missing
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} not reached within {timeout_s:.0f} s")


def _replica_states(app: str) -> dict[str, int]:
    """The model's engine replicas by state (its application also has the ingress request
    router HAProxy asks, docs/routing.md: not a replica of the model)."""
    from ray import serve

    engine = engine_deployment(MODEL_OF_APP[app])
    deployment = serve.status().applications[app].deployments[engine]
    return {str(state): n for state, n in deployment.replica_states.items()}


def _replicas(app: str) -> int:
    return _replica_states(app).get("RUNNING", 0)


def _ingress(list_actors) -> list[str]:
    return sorted(a.name for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                  if a.class_name.endswith("GatewayIngress"))


def _asks(url: str) -> dict:
    """Each model's greedy continuation on every protocol that names models (TGI serves its
    one configured model), and each protocol's model listing."""
    out: dict = {}
    with httpx.Client(base_url=url, timeout=60) as c:
        listing = urlsplit(README.check.split()[-1]).path  # the README's curl
        out["openai_models"] = sorted(m["id"] for m in c.get(listing).json()["data"])
        out["lmi_models"] = sorted(m["modelName"] for m in c.get("/models").json()["models"])
        for model in (A, B):
            got: dict = {}
            got["openai"] = c.post("/v1/completions", json={
                "model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True}).json()["choices"][0]["text"]
            got["mindie"] = c.post(f"/v2/models/{model}/generate", json={
                "text_input": PROMPT, "parameters": {"max_new_tokens": TOKENS,
                                                     "ignore_eos": True}}).json()["text_output"]
            lmi = c.post(f"/predictions/{model}", json={
                "inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS, "do_sample": False,
                                                 "ignore_eos": True}}).json()
            got["lmi"] = lmi["generated_text"]
            got["mindie_listing"] = c.get(f"/v2/models/{model}").status_code
            got["lmtp_tokens"] = asyncio.run(_lmtp(url, model))
            out[model] = got
        out["tgi"] = c.post("/generate", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": TOKENS, "ignore_eos_token": True}}).json()["generated_text"]
        gone = c.post("/v1/completions", json={"model": "no-such", "prompt": "x"})
        out["unknown_model"] = [gone.status_code, sorted(gone.json())]
    return out


async def _lmtp(url: str, model: str) -> int:
    import websockets

    async with websockets.connect(url.replace("http", "ws") + "/lmtp") as ws:
        # LMTP prompts are token ids (LMQL tokenizes client-side); a random model may end early.
        await ws.send("GENERATE " + json.dumps({"model": model, "prompt": [504, 3575, 282, 4649],
                                                "stream_id": 1, "max_tokens": TOKENS,
                                                "temperature": 0}))
        tokens = 0
        while True:
            kind, _, body = (await asyncio.wait_for(ws.recv(), 60)).partition(" ")
            items = json.loads(body)
            assert kind == "TOKEN", (kind, items)
            tokens += sum(1 for i in items if "token" in i)
            if any(i.get("finish_reason") or "error" in i for i in items):
                return tokens


def _burst(url: str, until, max_s: float) -> list[int]:
    """Concurrent long requests on model A until ``until()`` holds (checked every 0.5 s) or
    ``max_s`` passed; the status codes seen."""
    statuses: list[int] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json={"model": A, "prompt": PROMPT,
                                                    "max_tokens": 64, "ignore_eos": True})
                statuses.append(r.status_code)

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # a status read that failed: ask again
            if until():
                break
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join()
    return statuses


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from gateway import serve_env

    serve_env.apply()
    # The test session's own gateway, behind its HAProxy, runs beside this instance.
    serve_env.separate_haproxy()
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from engines.kit.embedded import EMBEDDED_MODEL_NAME, local_model_dir
    from tests.pipeline_models import build_tiny

    tmp = Path(tempfile.mkdtemp(prefix="cluster-models-"))
    tokenizer = Path(local_model_dir(f"embedded:{EMBEDDED_MODEL_NAME}") or "")
    a_dir, b_dir = build_tiny("llama", tmp / "a", tokenizer), build_tiny("llama-tied", tmp / "b",
                                                                          tokenizer)
    dashboard_port, http_port = free_port(), free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"llm_gateway_cpu_engine": 1},
        "include_dashboard": True, "dashboard_port": dashboard_port})
    cluster.add_node(num_cpus=2, resources={"pipeline_stage": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    url = f"http://127.0.0.1:{http_port}"
    result: dict = {"nodes": len([n for n in ray.nodes() if n["Alive"]])}
    try:
        started = time.monotonic()
        # With Ray's token auth on (a ~/.ray/auth_token exists, or RAY_AUTH_MODE=token inherited
        # from a test session's ray.init), the dashboard answers 401 to a request without it.
        from ray._private.authentication.http_token_authentication import (
            get_auth_headers_if_auth_enabled,
        )

        auth = get_auth_headers_if_auth_enabled({})
        _wait(lambda: httpx.get(f"{dashboard}/api/version", headers=auth).status_code == 200,
              "dashboard")
        _deploy(_serve_config(http_port, a_dir, b_dir, True), tmp / "serve.yaml", dashboard)
        _wait(lambda: httpx.get(f"{url}/health").status_code == 200
              and _replicas(APP_B) == 2, "both models up", timeout_s=600)
        result["deploy_s"] = round(time.monotonic() - started, 1)
        result["readme_status"] = _readme_status(dashboard)
        result["asks"] = _asks(url)

        # Where things run: replica and stage actors by node.
        head = next(n["NodeID"] for n in ray.nodes() if "llm_gateway_cpu_engine" in n["Resources"])
        actors = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)]
        result["placement"] = {
            "head": head,
            "a_replicas": [a.node_id for a in actors if a.class_name.endswith(f"engine-{A}")],
            "b_replicas": [a.node_id for a in actors if a.class_name.endswith(f"engine-{B}")],
            "b_stages": [a.node_id for a in actors if (a.name or "").startswith(f"{B}:stage")],
        }

        # Autoscaling: replica counts of model A through a burst and after it. The burst lasts
        # until the second replica is RUNNING plus a few seconds (bounded): starting a replica
        # (a stage actor importing torch, loading weights) under a saturated 2-core CI box took
        # longer than the fixed 45 s burst this used to be, so the new replica was torn down
        # again before it ever ran.
        timeline: list[tuple[float, int]] = []
        states: list[tuple[float, dict[str, int]]] = []
        t0 = time.monotonic()
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                with contextlib.suppress(Exception):
                    now, got = round(time.monotonic() - t0, 1), _replica_states(APP_A)
                    timeline.append((now, got.get("RUNNING", 0)))
                    if not states or states[-1][1] != got:
                        states.append((now, got))
                time.sleep(0.5)

        sampler = threading.Thread(target=sample)
        sampler.start()
        up_seen: list[float] = []

        def up_a_while() -> bool:
            if not up_seen and _replicas(APP_A) == 2:
                up_seen.append(time.monotonic())
            return bool(up_seen) and time.monotonic() - up_seen[0] > 5

        statuses = _burst(url, up_a_while, max_s=300)
        burst_end = round(time.monotonic() - t0, 1)
        _wait(lambda: _replicas(APP_A) == 1, "scale-down", timeout_s=120)
        time.sleep(1)
        sampling.set()
        sampler.join()
        result["autoscaling"] = {"timeline": timeline, "states": states,
                                 "burst_end_s": burst_end,
                                 "burst_statuses": sorted(set(statuses)),
                                 "burst_requests": len(statuses)}

        # Remove model B with `serve deploy` while a client keeps asking model A. First wait
        # for the scaled-down replica (and its stage actor) to be gone, not merely stopping.
        def a_actors() -> list[str]:
            return sorted(a.name for a in list_actors(filters=[("state", "=", "ALIVE")],
                                                      limit=1000)
                          if a.class_name.endswith(f"engine-{A}")
                          or (a.name or "").startswith(f"{A}:stage"))

        _wait(lambda: len(a_actors()) == 2, "model A down to one replica and its stage", 120)
        before = a_actors()
        ingress_before = _ingress(list_actors)
        seen: list[int | str] = []
        odd: list[str] = []  # the first answers that were not a 200
        asking = threading.Event()

        def ask_a() -> None:
            with httpx.Client(base_url=url, timeout=60) as c:
                while not asking.is_set():
                    try:
                        r = c.post("/v1/completions", json={"model": A, "prompt": PROMPT,
                                                            "max_tokens": 4})
                        seen.append(r.status_code)
                        if r.status_code != 200 and len(odd) < 3:
                            odd.append(r.text[:300])
                    except httpx.HTTPError as exc:
                        seen.append(type(exc).__name__)

        asker = threading.Thread(target=ask_a)
        asker.start()
        time.sleep(2)
        _deploy(_serve_config(http_port, a_dir, b_dir, False), tmp / "serve.yaml", dashboard)

        def settled() -> bool:
            from ray import serve

            apps = serve.status().applications
            ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
            return (APP_B not in apps and ids == [A]
                    and all(str(apps[n].status).endswith("RUNNING") for n in apps))

        _wait(settled, "model B removed", timeout_s=300)
        time.sleep(3)
        asking.set()
        asker.join()
        after = a_actors()
        ingress_after = _ingress(list_actors)
        with httpx.Client(base_url=url, timeout=60) as c:
            gone = c.post("/v1/completions", json={"model": B, "prompt": PROMPT, "max_tokens": 4})
        result["redeploy"] = {
            "a_actors_before": before, "a_actors_after": after,
            "ingress_before": ingress_before, "ingress_after": ingress_after,
            "a_statuses": {str(s): seen.count(s) for s in set(seen)}, "a_odd": odd,
            "b_after": [gone.status_code, gone.json().get("error", {}).get("type")],
        }
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()

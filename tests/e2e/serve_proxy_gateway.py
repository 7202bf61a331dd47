"""Run as a program (``python -m tests.e2e.serve_proxy_gateway``) by ``test_serve_proxy_e2e.py``:
the layout with Serve's proxy actor on the public port instead of HAProxy
(``LLM_GATEWAY_INGRESS=serve``), in a Ray instance of its own (the setting is read when Serve
starts; the test session runs the default, HAProxy). It asks the gateway on every protocol
through the proxy, drops a stream mid-way, and prints one ``RESULT`` JSON line; the test
compares the texts with vLLM's own output from the session's engine replica."""

from __future__ import annotations

import asyncio
import json
import os

import httpx

from gateway.serve_env import free_port
from tests.e2e.aborts import drop_stream, engine_stats, wait_for_abort
from tests.e2e.cluster_models import _wait
from tests.serve_session import VLLM_TEST_ARGS

PROMPT = "The capital of France is"
TOKENS = 12


def _listeners(port: int) -> list[str]:
    """Names of the processes listening on ``port`` (HAProxy, or Serve's proxy worker)."""
    import psutil

    names = []
    for proc in psutil.process_iter(["name"]):
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in proc.net_connections("tcp")):
                names.append(proc.info["name"])
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
    return names


async def _lmtp(url: str, model: str, prompt_ids: list[int]) -> list[int]:
    import websockets

    async with websockets.connect(url.replace("http://", "ws://") + "/") as ws:
        await ws.send("GENERATE " + json.dumps({"model": model, "prompt": prompt_ids,
                                                "stream_id": 1, "max_tokens": TOKENS,
                                                "temperature": 0}))
        tokens: list[int] = []
        while True:
            kind, _, body = (await asyncio.wait_for(ws.recv(), 120)).partition(" ")
            assert kind == "TOKEN", (kind, body)
            for item in json.loads(body):
                assert item.get("error") is None, item
                tokens.append(item["token"])
                if item.get("finish_reason"):
                    return tokens


def _asks(url: str, model: str) -> dict:
    from huggingface_hub import InferenceClient
    from openai import OpenAI

    out: dict = {}
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    out["openai"] = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS,
                                              temperature=0).choices[0].text
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS,
                                       temperature=0, stream=True)
    out["openai_stream"] = "".join(c.choices[0].text for c in stream if c.choices)
    # Held in a name: the client closes its open streams when it is collected.
    tgi = InferenceClient(model=url, timeout=120)
    out["tgi_stream"] = "".join(tgi.text_generation(PROMPT, max_new_tokens=TOKENS, stream=True))
    with httpx.Client(base_url=url, timeout=120) as http:
        out["mindie"] = http.post(f"/v2/models/{model}/generate", json={
            "text_input": PROMPT, "parameters": {"max_new_tokens": TOKENS}}).json()["text_output"]
        out["lmi"] = http.post("/invocations", json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS, "do_sample": False}}
        ).json()["generated_text"]
        prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        out["prompt_ids"] = prompt_ids
        out["lmtp_tokens"] = asyncio.run(_lmtp(url, model, prompt_ids))
        unknown = http.post("/v1/completions", json={"model": "no-such", "prompt": "x"})
        out["unknown_model"] = [unknown.status_code, sorted(unknown.json())]
        out["request_ids"] = _request_ids(http, model)
        out["disconnect"] = _disconnect(http, model)
    return out


def _request_ids(http: httpx.Client, model: str) -> list[list[str]]:
    """The ``x-request-id`` headers of a completion with the client's id, of one without, and
    of a refusal with the client's id."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    mine = {"x-request-id": "client-proxy-1"}
    return [http.post("/v1/completions", json=body, headers=mine).headers.get_list("x-request-id"),
            http.post("/v1/completions", json=body).headers.get_list("x-request-id"),
            http.post("/v1/completions", json={**body, "model": "no-such"}, headers=mine
                      ).headers.get_list("x-request-id")]


def _disconnect(http: httpx.Client, model: str) -> dict:
    """A stream dropped after its first event: the engine request is aborted."""
    before = engine_stats(http, model)["aborted"]
    drop_stream(http, "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 400, "stream": True,
        "ignore_eos": True}, lines=1, prefix="data: {")
    now = wait_for_abort(http, model, before)
    return {"aborted_before": before, "aborted_after": now["aborted"], "active": now["active"]}


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.pop("RAY_ADDRESS", None)
    from gateway import serve_env

    # The test session's environment has its HAProxy settings: this instance runs without.
    for key in (*serve_env.HAPROXY_ENV, "RAY_SERVE_HAPROXY_BINARY_PATH"):
        os.environ.pop(key, None)
    os.environ[serve_env.INGRESS_VAR] = "serve"
    serve_env.apply()
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from engines.kit.config import ModelConfig
    from engines.kit.embedded import EMBEDDED_MODEL_NAME
    from gateway.app import build_app
    from gateway.config import GatewayConfig

    model = EMBEDDED_MODEL_NAME
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = GatewayConfig(models=[ModelConfig(name=model, num_cpus=0.5,
                                                   engine_args=VLLM_TEST_ARGS)],
                               ingress_num_cpus=0.1)
        serve.run(build_app(config), name="gateway", route_prefix="/")
        _wait(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200,
              "the gateway behind Serve's proxy healthy", timeout_s=600)
        result = {"asks": _asks(url, model), "listeners": _listeners(port),
                  "actors": sorted({a.class_name for a in list_actors(
                      filters=[("state", "=", "ALIVE")], limit=1000)}),
                  "deployments": sorted(serve.status().applications["gateway"].deployments)}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()

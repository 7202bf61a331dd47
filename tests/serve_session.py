"""One real gateway (Ray Serve + vLLM on the embedded model) for the whole test session,
shared by the end-to-end tests and the engine contract suite's real-engine runs."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import uvicorn

from engines.kit.config import Controllers, ModelConfig
from engines.kit.embedded import EMBEDDED_MODEL_NAME
from gateway import serve_env
from gateway.config import GatewayConfig
from gateway.model_routes import model_route
from gateway.serve_env import free_port

MODEL = EMBEDDED_MODEL_NAME
APP_NAME = "gateway"
MODEL_APP = "model"  # the model's own application
# Small, so the 413 path is exercised through Ray Serve without shipping 64 MiB bodies.
MAX_REQUEST_BYTES = 1 << 20
METRICS_REPORT_MS = 2000
# Ray's CPUs are placement tokens here, not cores: the session's applications reserve ~2.05 of
# them in all (the vLLM replica 0.5 and its ingress 0.25, the pipeline 0.75, the colocated 0.2,
# the metered 0.1, the faults 0.25) and stand idle most of the time. On a 2-core box Ray would
# offer 2, and Serve waits forever for a replica it cannot place.
SESSION_CPUS = 4
# The session's vLLM engines run eager: vLLM's torch.compile warm-up took ~60 s of every engine
# start on the 2-core box (three starts a run: this model, the colocated one, the one behind
# Serve's proxy), and what the tests check does not depend on it. bench/ runs the compiled
# default.
VLLM_TEST_ARGS = {"enforce_eager": True}



def _wait_healthy(url: str, what: str, timeout_s: float = 600) -> None:
    """Poll ``url``/health until it answers 200 (connection errors while starting included)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"{what} did not become healthy within {timeout_s:.0f} s")


@pytest.fixture(scope="session")
def gateway_url():
    import ray
    from ray import serve

    from gateway.app import build_app, build_model_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Serve's proxy inherits Ray's environment: errors it writes itself come in shape.
    serve_env.apply()
    port = free_port()
    ray.init(num_cpus=SESSION_CPUS, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}},
             # Metrics reach the agents in 2 s instead of 10 (the observability tests wait on
             # them); one small export per process every 2 s.
             _system_config={"metrics_report_interval_ms": METRICS_REPORT_MS})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # serve_config.yaml's layout: the model its own application (its replicas serve it over
        # HTTP, HAProxy sends requests naming it there), the gateway application for the rest.
        # The operator's example controller, as serve_config.yaml registers it.
        controllers = Controllers(custom={"redact": "engines.controllers.api.examples:Redact"})
        model = ModelConfig(name=MODEL, controllers=controllers, engine_args=VLLM_TEST_ARGS)
        settings = {"aliases": {"ensemble": MODEL}, "max_request_bytes": MAX_REQUEST_BYTES}
        serve.run(build_model_app({"model": msgspec.to_builtins(model), "gateway": settings}),
                  name=MODEL_APP, route_prefix=model_route(MODEL))
        config = GatewayConfig(models=[msgspec.structs.replace(model, app=MODEL_APP)],
                               **settings)
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, "the gateway")
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


# The same embedded model as a 3-stage pipeline (engines.pipeline; a middle stage to kill), in a
# second application of the same Serve instance, so every existing test keeps its single-model
# gateway.
PIPELINE_MODEL = f"{EMBEDDED_MODEL_NAME}-pipeline"
PIPELINE_APP = "pipeline"
PIPELINE_ARGS = {"num_stages": 3, "stage_num_cpus": 0.15}


@pytest.fixture(scope="session")
def pipeline_url(gateway_url):
    from ray import serve

    from gateway.app import build_app

    config = GatewayConfig(models=[ModelConfig(name=PIPELINE_MODEL, engine="pipeline",
                                               num_cpus=0.2, engine_args=PIPELINE_ARGS)],
                           ingress_num_cpus=0.1, max_request_bytes=MAX_REQUEST_BYTES)
    serve.run(build_app(config), name=PIPELINE_APP, route_prefix=f"/{PIPELINE_APP}")
    url = f"{gateway_url}/{PIPELINE_APP}"
    _wait_healthy(url, "the pipeline gateway")
    return url


# The embedded model colocated with its ingress (ModelConfig.colocated: the engine inside the
# ingress replica), in a third application: the same model as the session's, so the session's
# own engine replica is the oracle.
COLOCATED_MODEL = f"{EMBEDDED_MODEL_NAME}-colocated"
COLOCATED_APP = "colocated"


@pytest.fixture(scope="session")
def colocated_url(gateway_url):
    from ray import serve

    from gateway.app import build_app

    config = GatewayConfig(models=[ModelConfig(name=COLOCATED_MODEL, colocated=True,
                                               num_cpus=0.1, engine_args=VLLM_TEST_ARGS)],
                           ingress_num_cpus=0.1, max_request_bytes=MAX_REQUEST_BYTES)
    serve.run(build_app(config), name=COLOCATED_APP, route_prefix=f"/{COLOCATED_APP}")
    url = f"{gateway_url}/{COLOCATED_APP}"
    _wait_healthy(url, "the colocated gateway")
    return url


@pytest.fixture(scope="session")
def pipeline_handle(pipeline_url):
    from ray import serve

    return serve.get_deployment_handle(f"engine-{PIPELINE_MODEL}", app_name=PIPELINE_APP)


@pytest.fixture(scope="session")
def engine_handle(gateway_url):
    from ray import serve

    return serve.get_deployment_handle(f"engine-{MODEL}", app_name=MODEL_APP)


# Prefill (SCORE, prompt logprobs) and decode compute the same logprob through different
# kernels; how far they may drift apart follows the dtype the engine actually computes in. In
# bf16 a logit near 20 is only resolved to 0.125 (8 significant bits): measured on the embedded
# model (AVX512-BF16 box, 8 prompts x 16 greedy tokens), SCORE vs GENERATE differed by 0.119 at
# most (mean 0.02). fp32 keeps them within 1e-3; fp16 has 3 more bits than bf16.
LOGPROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.05}


@pytest.fixture(scope="session")
def logprob_tolerance(engine_handle) -> float:
    """Absolute tolerance between logprobs of one token computed on different engine paths."""
    return LOGPROB_TOLERANCE[engine_handle.model_info.remote().result().dtype]


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free port in a background thread."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "uvicorn did not shut down"

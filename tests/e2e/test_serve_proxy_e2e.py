"""The layout with Serve's proxy actor, not HAProxy, on the public port
(``LLM_GATEWAY_INGRESS=serve``) end to end. It runs in a Ray instance of its own
(``tests.e2e.serve_proxy_gateway``, a subprocess); the oracle is vLLM's own greedy output from
the test session's engine replica of the same model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engines.kit.embedded import EMBEDDED_MODEL_NAME
from tests.e2e.serve_proxy_gateway import PROMPT, TOKENS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def proxy_run() -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.e2e.serve_proxy_gateway"],
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout[-2000:], done.stderr[-4000:])
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_serves_proxy_not_haproxy_listens_on_the_public_port(proxy_run):
    assert proxy_run["listeners"] and "haproxy" not in proxy_run["listeners"]
    assert "ProxyActor" in proxy_run["actors"] and "HAProxyManager" not in proxy_run["actors"]
    assert proxy_run["deployments"] == ["GatewayIngress", f"engine-{EMBEDDED_MODEL_NAME}"]


def test_every_protocol_through_serves_proxy_equals_vllm(proxy_run, engine_handle):
    asks = proxy_run["asks"]
    reference = engine_handle.reference_greedy.remote(PROMPT, TOKENS).result()
    for key in ("openai", "openai_stream", "tgi_stream", "mindie", "lmi"):
        assert asks[key] == reference.text, (key, asks[key], reference.text)
    by_ids = engine_handle.reference_greedy.remote(asks["prompt_ids"], TOKENS).result()
    assert asks["lmtp_tokens"] == by_ids.token_ids
    assert asks["unknown_model"] == [404, ["error"]]


def test_one_request_id_per_response_behind_serves_proxy(proxy_run):
    mine, theirs, refused = proxy_run["asks"]["request_ids"]
    assert mine == ["client-proxy-1"] and refused == ["client-proxy-1"]
    assert len(theirs) == 1 and theirs[0] not in ("", "client-proxy-1")


def test_a_dropped_stream_aborts_the_engine_request_behind_serves_proxy(proxy_run):
    gone = proxy_run["asks"]["disconnect"]
    assert gone["aborted_after"] == gone["aborted_before"] + 1 and gone["active"] == 0

"""The fastest single-model layout end to end: the engine inside the ingress replica
(``colocated``) behind Ray Serve's HAProxy ingress (``LLM_GATEWAY_INGRESS=haproxy``), with
HAProxy, not Serve's proxy actor, on the public port. It runs in a Ray instance of its own
(``tests.e2e.haproxy_gateway``, a subprocess); the oracle is vLLM's own greedy output from the
test session's separate engine replica of the same model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.haproxy_gateway import PROMPT, TOKENS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def haproxy_run() -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.e2e.haproxy_gateway"],
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout[-2000:], done.stderr[-4000:])
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_haproxy_not_serves_proxy_listens_on_the_public_port(haproxy_run):
    # Serve keeps a proxy actor (its gRPC side) beside HAProxy; what matters is who owns the
    # public HTTP port.
    assert haproxy_run["listeners"] == ["haproxy"]
    assert "HAProxyManager" in haproxy_run["actors"]
    assert haproxy_run["deployments"] == ["GatewayIngress"]  # the engine is in the ingress


def test_every_protocol_through_haproxy_equals_vllm(haproxy_run, engine_handle):
    asks = haproxy_run["asks"]
    reference = engine_handle.reference_greedy.remote(PROMPT, TOKENS).result()
    for key in ("openai", "openai_stream", "tgi_stream", "mindie", "lmi"):
        assert asks[key] == reference.text, (key, asks[key], reference.text)
    by_ids = engine_handle.reference_greedy.remote(asks["prompt_ids"], TOKENS).result()
    assert asks["lmtp_tokens"] == by_ids.token_ids
    assert asks["unknown_model"] == [404, ["error"]]


def test_a_dropped_stream_aborts_the_engine_request_behind_haproxy(haproxy_run):
    gone = haproxy_run["asks"]["disconnect"]
    assert gone["aborted_after"] == gone["aborted_before"] + 1 and gone["active"] == 0

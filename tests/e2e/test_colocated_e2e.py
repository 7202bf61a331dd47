"""A model colocated with the ingress (``ModelConfig.colocated``: the vLLM engine inside the
gateway's ingress replica, no Ray hop between engine and protocol encoders) end to end through
Ray Serve, with the real clients. Oracle: vLLM's own greedy output from the session's separate
engine replica of the same model (``reference_greedy``), never the colocated path itself."""

from __future__ import annotations

import httpx
import pytest
from huggingface_hub import InferenceClient

from tests.e2e.aborts import drop_stream, engine_stats, wait_for_abort
from tests.serve_session import COLOCATED_APP, COLOCATED_MODEL

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
TOKENS = 12


@pytest.fixture(scope="module")
def reference(engine_handle):
    return engine_handle.reference_greedy.remote(PROMPT, TOKENS).result()


@pytest.fixture
def http(colocated_url):
    with httpx.Client(base_url=colocated_url, timeout=120) as client:
        yield client


def test_the_engine_runs_inside_the_ingress_replica(colocated_url):
    from ray import serve

    deployments = serve.status().applications[COLOCATED_APP].deployments
    assert list(deployments) == ["GatewayIngress"]  # no engine deployment of its own


def test_openai_sdk_greedy_equals_vllm_of_a_separate_replica(colocated_url, reference,
                                                             logprob_tolerance):
    from openai import OpenAI

    client = OpenAI(base_url=f"{colocated_url}/v1", api_key="unused", max_retries=0,
                    timeout=120)
    whole = client.completions.create(model=COLOCATED_MODEL, prompt=PROMPT, max_tokens=TOKENS,
                                      temperature=0, logprobs=1)
    assert whole.choices[0].text == reference.text
    assert whole.usage.completion_tokens == TOKENS
    for got, want in zip(whole.choices[0].logprobs.token_logprobs, reference.logprobs,
                         strict=True):
        assert got == pytest.approx(want, abs=logprob_tolerance)
    stream = client.completions.create(model=COLOCATED_MODEL, prompt=PROMPT, max_tokens=TOKENS,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference.text


def test_tgi_and_mindie_streams_give_the_same_text(colocated_url, http, reference):
    tgi = InferenceClient(model=colocated_url, timeout=60)
    text = "".join(tgi.text_generation(PROMPT, max_new_tokens=TOKENS, stream=True))
    assert text == reference.text
    mindie = http.post(f"/v2/models/{COLOCATED_MODEL}/generate", json={
        "text_input": PROMPT, "parameters": {"max_new_tokens": TOKENS}})
    assert mindie.status_code == 200 and mindie.json()["text_output"] == reference.text


def test_a_client_disconnect_aborts_the_colocated_engine_request(http):
    aborted = engine_stats(http, COLOCATED_MODEL)["aborted"]
    drop_stream(http, "/v1/completions", {
        "model": COLOCATED_MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True,
        "ignore_eos": True}, lines=1, prefix="data: {")
    now = wait_for_abort(http, COLOCATED_MODEL, aborted)
    assert now["aborted"] == aborted + 1 and now["active"] == 0

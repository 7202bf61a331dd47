"""MindIE / Triton v2 generate end to end with a raw SSE client, against real vLLM."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.e2e.aborts import drop_stream, engine_stats, wait_for_abort
from tests.e2e.conftest import MODEL
from tests.seed_examples import MINDIE_SEED_EXAMPLE

PROMPT = "The capital of France is"
URL = f"/v2/models/{MODEL}"
SEED_EXAMPLE = MINDIE_SEED_EXAMPLE  # verbatim (the model name is in the URL)


def _sse(http: httpx.Client, body: dict, path: str = f"{URL}/generate_stream") -> list[dict]:
    """Raw SSE: every event is exactly ``data:{json}`` and a blank line."""
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("\n\n")
    frames = raw[:-2].split("\n\n")
    assert all(f.startswith("data:{") for f in frames), raw[:200]
    return [json.loads(f[len("data:"):]) for f in frames]


def _error(response: httpx.Response, status: int, error_type: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type
    return body["error"]


def test_seed_example_streams_with_details(http):
    events = _sse(http, SEED_EXAMPLE)
    assert all(e["id"] == "a123" and e["model_name"] == MODEL and e["model_version"] is None
               for e in events)
    assert 1 <= events[-1]["details"]["generated_tokens"] <= 20
    assert [("finish_reason" in e["details"]) for e in events] == [False] * (len(events) - 1) + [
        True]
    assert events[-1]["details"]["finish_reason"] in ("eos_token", "length")
    first, rest = events[0], events[1:]
    assert first["prefill_time"] > 0 and first["decode_time"] is None
    assert all(e["prefill_time"] is None and e["decode_time"] >= 0 for e in rest)
    assert all(e["details"]["batch_size"] >= 1 for e in events)
    assert first["details"]["queue_wait_time"] >= 0
    assert [e["details"]["generated_tokens"] for e in events] == sorted(
        e["details"]["generated_tokens"] for e in events)


def test_greedy_stream_concatenates_to_generate_and_to_vllm_native(http, engine_handle):
    body = {"id": "g1", "text_input": PROMPT, "parameters": {"max_new_tokens": 12,
                                                              "details": True}}
    events = _sse(http, body)
    whole = http.post(f"{URL}/generate", json=body).json()
    native = engine_handle.reference_greedy.remote(PROMPT, 12).result()
    assert "".join(e["text_output"] for e in events) == whole["text_output"] == native.text
    assert whole["id"] == "g1" and whole["model_version"] is None
    details = whole["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 12
    assert details["first_token_cost"] is None and details["decode_cost"] is None
    assert len(details["batch_size"]) == len(details["queue_wait_time"]) == 12


def test_without_details_there_is_no_finish_reason(http):
    body = {"text_input": PROMPT, "parameters": {"max_new_tokens": 4}}
    whole = http.post(f"{URL}/generate", json=body).json()
    assert set(whole) == {"id", "model_name", "model_version", "text_output"}
    events = _sse(http, body)
    assert all(set(e) == {"id", "model_name", "model_version", "text_output"} for e in events)


def test_default_max_new_tokens_is_20(http):
    body = {"text_input": "Count: 1, 2, 3,", "parameters": {"details": True}}
    assert http.post(f"{URL}/generate", json=body).json()["details"]["generated_tokens"] <= 20


def test_priority_is_accepted(http):
    for priority in (1, 3, 5):
        body = {"text_input": PROMPT, "parameters": {"max_new_tokens": 2, "priority": priority}}
        assert http.post(f"{URL}/generate", json=body).status_code == 200


def test_timeout_ends_the_stream(http):
    body = {"text_input": PROMPT, "max_tokens": 1500, "end_id": 10**7,  # Triton: ignore EOS
            "parameters": {"details": True, "timeout": 1, "max_new_tokens": 1500}}
    started = time.monotonic()
    events = _sse(http, body)
    assert time.monotonic() - started < 30
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"  # cancelled, per the seed
    assert events[-1]["details"]["generated_tokens"] < 1500


def test_id_is_echoed_and_generated_when_absent(http):
    assert http.post(f"{URL}/generate", json={"id": "req_7-b", "text_input": PROMPT,
                                              "parameters": {"max_new_tokens": 1}}).json()[
        "id"] == "req_7-b"
    generated = http.post(f"{URL}/generate", json={"text_input": PROMPT,
                                                   "parameters": {"max_new_tokens": 1}}).json()
    assert generated["id"]


def test_triton_and_litellm_style_bodies(http):
    sglang = {"accumulate_tokens": True, "text_input": PROMPT, "temperature": 0.000001,
              "top_p": 1.0, "max_tokens": 8, "stream": True, "min_length": 8, "end_id": 1048576}
    # SGLang's trt backend hard-codes the model name "ensemble" (an alias in the config)
    events = _sse(http, sglang, "/v2/models/ensemble/generate_stream")
    assert events and events[-1]["model_name"] == "ensemble"  # every line parsed as data:{json}
    counted = http.post("/v2/models/ensemble/generate",
                        json={**sglang, "parameters": {"details": True}}).json()
    assert counted["details"]["generated_tokens"] == 8  # min_length/end_id: exactly N tokens
    litellm = {"text_input": PROMPT, "stream": False,
               "parameters": {"max_tokens": 5, "bad_words": [""], "stop_words": [""],
                              "details": True}}
    body = http.post(f"{URL}/generate", json=litellm).json()
    assert body["details"]["generated_tokens"] <= 5


@pytest.mark.parametrize("body", [
    {"id": "a b", "text_input": "x"},
    {"id": "", "text_input": "x"},
    {"id": "x" * 257, "text_input": "x"},
    {"id": 5, "text_input": "x"},
    {"parameters": {"max_new_tokens": 2}},
    {"text_input": ""},
    {"text_input": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": "a.png"}]},
    {"text_input": "hello " * 3000},  # beyond the model's context
    {"text_input": "x", "parameters": {"temperature": 0}},
    {"text_input": "x", "parameters": {"top_p": 0}},
    {"text_input": "x", "parameters": {"top_k": -1}},
    {"text_input": "x", "parameters": {"priority": 0}},
    {"text_input": "x", "parameters": {"priority": 6}},
    {"text_input": "x", "parameters": {"timeout": 0}},
    {"text_input": "x", "parameters": {"timeout": 3601}},
    {"text_input": "x", "parameters": {"max_new_tokens": 0}},
    {"text_input": "x", "parameters": {"max_new_tokens": 2.5}},
    {"text_input": "x", "parameters": {"repetition_penalty": 0}},
    {"text_input": "x", "parameters": {"details": "yes"}},
])
@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_validation_errors_are_422_before_any_stream(http, body, route):
    _error(http.post(f"{URL}/{route}", json=body), 422, "Input Validation Error")


def test_invalid_json_and_unknown_model(http):
    _error(http.post(f"{URL}/generate_stream", content=b'{"text_input": ',
                     headers={"content-type": "application/json"}), 422, "validation")
    message = _error(http.post("/v2/models/nope/generate", json={"text_input": "x"}), 404,
                     "NotFoundError")
    assert message == "Model nope not found."
    message = _error(http.post(f"{URL}/versions/1/generate_stream", json={"text_input": "x"}),
                     404, "NotFoundError")
    assert "versions" in message


def test_kserve_probes(http):
    assert http.get("/v2/health/live").status_code == 200
    assert http.get("/v2/health/ready").status_code == 200
    assert http.get(f"{URL}/ready").status_code == 200
    assert http.get("/v2/models/nope/ready").status_code == 404
    assert http.get(URL).json()["outputs"][0]["name"] == "text_output"


def test_disconnect_aborts_the_engine_request(gateway_url, http):
    before = engine_stats(http, MODEL)["aborted"]
    body = {"text_input": PROMPT, "max_tokens": 1500, "end_id": 10**7,
            "parameters": {"max_new_tokens": 1500}}
    with httpx.Client(base_url=gateway_url, timeout=60) as client:
        drop_stream(client, f"{URL}/generate_stream", body, prefix="data:")
    stats = wait_for_abort(http, MODEL, before)
    assert stats["aborted"] == before + 1 and stats["active"] == 0

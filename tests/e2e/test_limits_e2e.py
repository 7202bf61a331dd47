"""Oversized bodies through Ray Serve: a 413 in each protocol's shape, from each ecosystem's own
client where one exists, and the gateway keeps serving afterwards."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import text_generation
from text_generation.errors import ValidationError as TGIValidationError

from tests.e2e.conftest import MAX_REQUEST_BYTES, MODEL

BIG = "x" * (MAX_REQUEST_BYTES + 1)
MESSAGE = f"Request body exceeds the limit of {MAX_REQUEST_BYTES} bytes."


def _chunked(data: bytes):
    for start in range(0, len(data), 64 * 1024):
        yield data[start:start + 64 * 1024]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_lmi_oversized_body_is_413(gateway_url, chunked):
    data = json.dumps({"inputs": BIG, "parameters": {"max_new_tokens": 2}}).encode()
    r = httpx.post(f"{gateway_url}/invocations", timeout=60,
                   content=_chunked(data) if chunked else data)
    assert r.status_code == 413
    assert r.json() == {"code": 413, "type": "ServiceException", "message": MESSAGE}
    ok = httpx.post(f"{gateway_url}/invocations", timeout=60,
                    json={"inputs": "The capital of France is",
                          "parameters": {"max_new_tokens": 4, "do_sample": False}})
    assert ok.status_code == 200 and ok.json()["generated_text"].strip().startswith("Paris")


def test_tgi_client_gets_a_validation_error(gateway_url):
    client = text_generation.Client(gateway_url, timeout=60)
    with pytest.raises(TGIValidationError, match="exceeds the limit"):
        client.generate(BIG, max_new_tokens=2)
    assert client.generate("The capital of France is", max_new_tokens=4).generated_text


def test_openai_sdk_gets_a_413(openai_client):
    with pytest.raises(openai.APIStatusError) as info:
        openai_client.completions.create(model=MODEL, prompt=BIG, max_tokens=2)
    assert info.value.status_code == 413
    assert info.value.body["message"] == MESSAGE


def test_mindie_oversized_body_is_413(gateway_url):
    r = httpx.post(f"{gateway_url}/v2/models/{MODEL}/generate_stream", timeout=60,
                   json={"text_input": BIG, "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 413
    assert r.json() == {"error": MESSAGE, "error_type": "Input Validation Error"}

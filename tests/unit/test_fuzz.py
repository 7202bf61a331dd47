"""Property-based fuzzing of every generation route and of LMTP frames (fake engine, no Ray).

Bodies are valid requests with fields replaced by arbitrary JSON, arbitrary JSON documents,
and raw bytes. The property: never a 5xx, never a traceback or exception text, errors in JSON,
streams that end; and the app still serves a plain request afterwards. The same strategies run
through Ray Serve against vLLM in ``tests/e2e/test_reliability_e2e.py`` (fewer cases).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from tests.fake_engine import FakeEngine

CASES = 200  # per route

# What only a Python exception or a parser writes: no answer may carry any of it (a client gets
# a fixed message per failure class instead; the detail goes to the log).
EXCEPTION_TEXT = ("Traceback", "Error(", "codec can't decode", "maximum recursion depth",
                  "Expecting property name", "Expecting value", "set_int_max_str_digits",
                  "Exceeds the limit", "line 1 column", "JSON is malformed",
                  "Input data was truncated", "object has no attribute",
                  "unexpected keyword argument", "positional argument", "not subscriptable",
                  "NoneType", "invalid literal for int", "could not convert", "unhashable type",
                  "KeyError", "TypeError", "ValueError", "AttributeError", "RuntimeError",
                  "UnicodeDecodeError", "RecursionError", "IndexError", "OverflowError")


def assert_no_exception_text(text: str) -> None:
    found = [fragment for fragment in EXCEPTION_TEXT if fragment in text]
    assert not found, (found, text[:500])

_TEXTGEN_PARAMS = ["max_new_tokens", "temperature", "top_k", "top_p", "do_sample", "details",
                   "decoder_input_details", "seed", "stop", "truncate", "typical_p", "best_of",
                   "return_full_text", "repetition_penalty", "frequency_penalty",
                   "top_n_tokens", "grammar", "n", "watermark", "adapter_id"]
_MINDIE_PARAMS = ["max_new_tokens", "temperature", "top_k", "top_p", "do_sample", "details",
                  "seed", "stop", "typical_p", "repetition_penalty", "priority", "timeout",
                  "batch_size", "watermark", "stop_token_ids", "best_of", "n"]
_OPENAI_FIELDS = ["model", "max_tokens", "temperature", "top_p", "n", "best_of", "stream",
                  "stop", "logprobs", "echo", "logit_bias", "seed", "priority", "min_tokens",
                  "presence_penalty", "frequency_penalty", "stream_options", "top_k",
                  "ignore_eos", "prompt_logprobs", "response_format", "suffix", "user",
                  "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
                  "controller", "controller_arg"]

# path → (a valid body, top-level fields to vary, fields of "parameters" to vary)
ROUTES: dict[str, tuple[dict[str, Any], list[str], list[str]]] = {
    "/v1/completions": ({"model": "fake-model", "prompt": "Hi", "max_tokens": 3},
                        ["prompt", *_OPENAI_FIELDS], []),
    "/v1/chat/completions": (
        {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}],
         "max_tokens": 3},
        ["messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
         *_OPENAI_FIELDS], []),
    "/tokenize": ({"model": "fake-model", "prompt": "Hi"},
                  ["model", "prompt", "messages", "add_special_tokens", "return_token_strs"], []),
    "/detokenize": ({"model": "fake-model", "tokens": [72, 105]}, ["model", "tokens"], []),
    "/generate": ({"inputs": "Hi", "parameters": {"max_new_tokens": 3}},
                  ["inputs", "parameters", "stream"], _TEXTGEN_PARAMS),
    "/generate_stream": ({"inputs": "Hi", "parameters": {"max_new_tokens": 3}},
                         ["inputs", "parameters"], _TEXTGEN_PARAMS),
    "/invocations": ({"inputs": "Hi", "parameters": {"max_new_tokens": 3}},
                     ["inputs", "parameters", "stream"], _TEXTGEN_PARAMS),
    "/v2/models/fake-model/generate": (
        {"text_input": "Hi", "parameters": {"max_new_tokens": 3}},
        ["text_input", "parameters", "id", "inputs"], _MINDIE_PARAMS),
    "/v2/models/fake-model/generate_stream": (
        {"text_input": "Hi", "parameters": {"max_new_tokens": 3}},
        ["text_input", "parameters", "id"], _MINDIE_PARAMS),
}

json_values = st.recursive(
    st.none() | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8)
# Values near the edges the translators check (ranges, 64-bit, lengths). Each draw is a fresh
# copy: sampled_from hands out the same object, and a body that stores the shared {} twice
# (as "parameters" and inside it) would become circular and poison every later example.
edge_values = st.sampled_from([0, -1, 1, 2, 63, 64, 65, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63),
                               0.0, -0.5, 1e308, "", "0", [], {}, [1] * 300, "x" * 300,
                               None]).map(copy.deepcopy)


@st.composite
def bodies(draw, path: str) -> bytes:
    base, fields, params = ROUTES[path]
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    body = json.loads(json.dumps(base))
    for field in draw(st.lists(st.sampled_from(fields), max_size=3)):
        body[field] = draw(json_values | edge_values)
    if params and isinstance(body.get("parameters"), dict):
        for field in draw(st.lists(st.sampled_from(params), max_size=3)):
            body["parameters"][field] = draw(json_values | edge_values)
    if draw(st.booleans()) and fields:
        body.pop(draw(st.sampled_from(fields)), None)
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def client():
    app = create_app(ModelRegistry({"fake-model": FakeEngine()}), GatewayConfig())
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _check(response) -> None:
    text = response.text  # reading it also drains a stream to its end
    assert response.status_code < 500, (response.status_code, text[:500])
    assert_no_exception_text(text)
    if response.status_code >= 400:
        json.loads(text)  # errors are JSON in every protocol's shape


@pytest.mark.parametrize("path", list(ROUTES))
def test_no_body_makes_a_route_fail_badly(client, path):
    @settings(max_examples=CASES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(body=bodies(path))
    def fuzz(body: bytes) -> None:
        _check(client.post(path, content=body, headers={"content-type": "application/json"}))

    fuzz()
    base = ROUTES[path][0]
    assert client.post(path, json=base).status_code == 200  # still serving


frames = st.one_of(
    st.text(max_size=80),
    st.builds(lambda cmd, payload: f"{cmd} {json.dumps(payload)}",
              st.sampled_from(["GENERATE", "SCORE", "MODEL_INFO", "FOO", "generate", ""]),
              st.fixed_dictionaries({"stream_id": st.integers(1, 10**6)},
                                    optional={"model": st.sampled_from(["fake-model", "x", 3]),
                                              "prompt": json_values | edge_values,
                                              "scored": json_values,
                                              "max_tokens": json_values | edge_values,
                                              "temperature": json_values,
                                              "logit_bias": json_values,
                                              "top_logprobs": json_values | edge_values})),
)


def test_no_lmtp_frame_breaks_the_connection(client):
    with client.websocket_connect("/lmtp") as ws:
        @settings(max_examples=CASES * 2, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow,
                                         HealthCheck.function_scoped_fixture])
        @given(frame=frames)
        def fuzz(frame: str) -> None:
            ws.send_text(frame)
            # A probe stream after each frame: its answer proves the connection still works,
            # and everything the frame caused has been read before it.
            ws.send_text('MODEL_INFO {"model": "fake-model", "stream_id": "probe"}')
            while True:
                kind, _, body = ws.receive_text().partition(" ")
                items = json.loads(body)
                assert kind in ("TOKEN", "MSG") and isinstance(items, list)
                for item in items:
                    assert_no_exception_text(json.dumps(item))
                if any(i.get("stream_id") == "probe" for i in items):
                    return

        fuzz()


@pytest.mark.parametrize("path", [*ROUTES, "/v1/run", "/v1/controllers/tags"])
@pytest.mark.parametrize("body", [b'"\x80"', b'{"prompt": "\xff\xfe", "inputs": "\xc3"}'])
def test_invalid_utf8_inside_json_strings_is_a_client_error_in_shape(client, path, body):
    """msgspec reports invalid UTF-8 inside a string as UnicodeDecodeError (not DecodeError):
    a 500 on MindIE's generate before this was caught by the fuzzer above."""
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert "Traceback" not in response.text and "UnicodeDecodeError" not in response.text


# The cases an independent probe found carrying Python's text, on every route.
HOSTILE_BODIES = [b"\xff", b'"\xff"', b"[" * 100_000, b'{"inputs": ' + b"9" * 5000 + b"}",
                  b'{"prompt": "Hi", "model": "fake-model", "max_tokens": ' + b"9" * 5000 + b"}",
                  b"{", b'{"inputs": "Hi"} trailing']


@pytest.mark.parametrize("path", [*ROUTES, "/v1/run", "/v1/controllers/tags"])
@pytest.mark.parametrize("body", HOSTILE_BODIES, ids=range(len(HOSTILE_BODIES)))
def test_hostile_bodies_get_a_fixed_message_in_shape(client, path, body):
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    # (a route that has no such field may skip it: /tokenize has no max_tokens)
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.headers["content-type"].startswith("application/json"):  # AICI's are text
        json.loads(response.text)
    assert_no_exception_text(response.text)


@pytest.mark.parametrize("frame", [
    "GENERATE {", "GENERATE " + "[" * 100_000, "GENERATE \xff",
    'GENERATE {"model": "fake-model", "prompt": [1], "stream_id": ' + "9" * 5000 + "}",
    'GENERATE {"model": "fake-model", "prompt": [1], "stream_id": 7, "max_tokens": '
    + "9" * 5000 + "}",
])
def test_hostile_lmtp_frames_get_a_fixed_message(client, frame):
    with client.websocket_connect("/lmtp") as ws:
        ws.send_text(frame)
        kind, _, body = ws.receive_text().partition(" ")
        assert kind in ("TOKEN", "MSG") and json.loads(body)[0]["error"]
        assert_no_exception_text(body)

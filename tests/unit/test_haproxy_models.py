"""HAProxy sends a request naming a model straight to that model's own application: Serve's
real template rendered by Serve's own ``HAProxyApi`` for a gateway at ``/`` and two models at
``/model/<name>``, shaped by ``llm-gateway-haproxy``, served by the real HAProxy binary; each
stand-in replica answers with which application it is and the path it was asked for."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
import time

import httpx
import pytest

from gateway.edge.haproxy_models import BODY_WAIT_VAR, model_rules
from gateway.shapes import NOT_RECEIVED, ErrorShapes
from tests.unit.test_haproxy_errors import _ServesProxy, start_haproxy


class _Echo(http.server.ThreadingHTTPServer):
    """A replica of application ``name``: answers every request with its name and path."""

    def __init__(self, name: str):
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self):
                size = int(self.headers.get("content-length") or 0)
                self.rfile.read(size)
                body = b"success" if self.path == "/-/healthz" else json.dumps(
                    {"app": name, "path": self.path}).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@contextlib.contextmanager
def _haproxy_before_echoes(directory: str):
    replicas = {prefix: _Echo(name) for prefix, name in
                [("/", "gateway"), ("/model/alpha", "alpha"), ("/model/org/beta", "org/beta")]}
    fallback = _ServesProxy()
    proc, url = start_haproxy(directory, {p: r.server_port for p, r in replicas.items()},
                              fallback.server_port)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        for replica in replicas.values():
            replica.shutdown()
        fallback.shutdown()


@pytest.fixture(scope="module")
def haproxy(tmp_path_factory):
    with _haproxy_before_echoes(str(tmp_path_factory.mktemp("haproxy"))) as url:
        yield url


def _where(response: httpx.Response) -> tuple[str, str]:
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["app"], answer["path"]


@pytest.mark.parametrize("path, body, expected", [
    ("/v1/completions", {"model": "alpha", "prompt": "Hi"},
     ("alpha", "/model/alpha/v1/completions")),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "model": "org/beta"},
     ("org/beta", "/model/org/beta/v1/chat/completions")),
    ("/tokenize", {"model": "alpha", "prompt": "Hi"}, ("alpha", "/model/alpha/tokenize")),
    ("/v2/models/alpha/generate_stream", {"text_input": "Hi"},
     ("alpha", "/model/alpha/v2/models/alpha/generate_stream")),
    ("/predictions/alpha", {"inputs": "Hi"}, ("alpha", "/model/alpha/predictions/alpha")),
    ("/models/alpha/invoke", {"inputs": "Hi"}, ("alpha", "/model/alpha/models/alpha/invoke")),
    ("/v1/completions?user=1", {"model": "alpha"}, ("alpha", "/model/alpha/v1/completions?user=1")),
    # Not a model with its own application, no model, or a path that names none: the gateway.
    ("/v1/completions", {"model": "gamma"}, ("gateway", "/v1/completions")),
    ("/v1/completions", {"prompt": "Hi"}, ("gateway", "/v1/completions")),
    ("/v1/completions", {"model": "alph"}, ("gateway", "/v1/completions")),
    ("/v1/completions", {"model": "alpha-2"}, ("gateway", "/v1/completions")),
    ("/generate", {"model": "alpha", "inputs": "Hi"}, ("gateway", "/generate")),
    ("/v1/run", {"model": "alpha"}, ("gateway", "/v1/run")),
    ("/v2/models/gamma/generate", {"text_input": "Hi"}, ("gateway", "/v2/models/gamma/generate")),
    ("/x/v1/completions", {"model": "alpha"}, ("gateway", "/x/v1/completions")),
])
def test_a_request_naming_a_model_goes_to_its_application(haproxy, path, body, expected):
    assert _where(httpx.post(haproxy + path, json=body, timeout=10)) == expected


def test_a_nested_model_key_is_not_the_requests_model(haproxy):
    body = {"metadata": {"model": "alpha"}, "model": "gamma"}
    assert _where(httpx.post(haproxy + "/v1/completions", json=body, timeout=10))[0] == "gateway"


def test_listings_and_probes_stay_with_the_gateway(haproxy):
    assert _where(httpx.get(haproxy + "/v1/models", timeout=10)) == ("gateway", "/v1/models")
    assert _where(httpx.get(haproxy + "/health", timeout=10)) == ("gateway", "/health")


def test_the_model_application_is_also_a_base_url_of_its_own(haproxy):
    response = httpx.post(haproxy + "/model/alpha/v1/completions", json={"model": "alpha"},
                          timeout=10)
    assert _where(response) == ("alpha", "/model/alpha/v1/completions")


def _headers_then_body(url: str, length: int, body: bytes | None, pause_s: float,
                       timeout_s: float) -> bytes:
    """HAProxy's answer to a completion whose headers (``Content-Length: length``) come
    ``pause_s`` before its body (``None``: the body never comes), read until its JSON ends or
    the connection closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % length)
        if body is not None:
            time.sleep(pause_s)
            conn.sendall(body)
        answer = b""
        while not answer.endswith(b"}") and (chunk := conn.recv(65536)):
            answer += chunk
    return answer


def test_a_body_sent_seconds_after_its_headers_still_names_the_model(haproxy):
    """HAProxy waits for the body (a client that sends headers first, then the body). A loaded
    client can take seconds between the two: CI's burst of 900 completions on two cores did, and
    HAProxy's wait, then 2 s, answered most of them 408 (its answer when the wait runs out)."""
    body = json.dumps({"model": "alpha", "prompt": "Hi"}).encode()
    answer = _headers_then_body(haproxy, len(body), body, pause_s=3, timeout_s=10)
    assert b'"app": "alpha"' in answer, answer


def test_a_body_that_stalls_past_the_wait_is_a_408_in_the_protocols_shape(tmp_path,
                                                                           monkeypatch):
    """The wait is a bound on a stalled client (HAProxy's answer when it runs out is a 408):
    the body of that 408 is the protocol's, with the gateway's message."""
    monkeypatch.setenv(BODY_WAIT_VAR, "1")
    with _haproxy_before_echoes(str(tmp_path)) as url:
        started = time.monotonic()
        answer = _headers_then_body(url, 40, None, pause_s=0, timeout_s=30)
        waited = time.monotonic() - started
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert b"content-type: application/json" in head.lower(), answer
    assert json.loads(body) == {"error": {"message": NOT_RECEIVED, "type": "Request Timeout",
                                          "param": None, "code": 408}}
    assert waited >= 1, waited


def test_a_model_named_past_haproxys_buffer_takes_the_gateways_route(haproxy):
    """Documented limit: HAProxy reads the body as far as its buffer (16 KB by default)."""
    body = {"prompt": "x" * 40_000, "model": "alpha"}
    assert _where(httpx.post(haproxy + "/v1/completions", json=body, timeout=10))[0] == "gateway"
    first = {"model": "alpha", "prompt": "x" * 40_000}  # named before the buffer ends
    assert _where(httpx.post(haproxy + "/v1/completions", json=first, timeout=10))[0] == "alpha"


def test_no_rules_without_a_models_application():
    assert model_rules(["/", "/pipeline"], ErrorShapes.of_every_protocol()) == []


def test_a_name_haproxy_cannot_carry_gets_no_rule():
    rules = model_rules(["/model/a b", "/model/ok"], ErrorShapes.of_every_protocol())
    assert any("/model/ok" in r for r in rules) and not any("a b" in r for r in rules)

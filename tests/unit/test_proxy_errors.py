"""The proxy middleware (``gateway.edge.proxy``) around stand-ins for what Serve's proxy does: no
response at all (the ingress died), plain-text errors (timeout, back-pressure), and normal
answers that must pass through unchanged. The real proxy is exercised in
``tests/e2e/test_reliability_e2e.py`` (an ingress replica killed mid-request)."""

from __future__ import annotations

import httpx
import pytest
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

from gateway.edge.proxy import ProxyErrorShape, middlewares


def _client(inner) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=ProxyErrorShape(inner), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://proxy")


async def _silent(scope, receive, send):
    """What Serve's proxy does when the ingress replica dies before answering."""


def _plain(status: int, text: str):
    async def app(scope, receive, send):
        await PlainTextResponse(text, status_code=status)(scope, receive, send)
    return app


async def _raising(scope, receive, send):
    raise RuntimeError("actor 7f3a at 10.0.0.5 died")


# path → what the protocol's client looks for in the body
SHAPES = {
    "/v1/completions": lambda b: b["error"]["code"] == 503 and "stopped" in b["error"]["message"],
    "/generate_stream": lambda b: b["error_type"] == "generation" and "stopped" in b["error"],
    "/invocations": lambda b: b["code"] == 503,
    "/v2/models/m/generate": lambda b: "stopped" in b["error"],
    # Under a Serve route prefix the owner is found on the suffix.
    "/pipeline/generate": lambda b: b["error_type"] == "generation",
    "/pipeline/v1/chat/completions": lambda b: b["error"]["code"] == 503,
}


@pytest.mark.parametrize("path", list(SHAPES))
async def test_no_response_becomes_a_503_in_the_protocols_shape(path):
    async with _client(_silent) as c:
        r = await c.post(path, json={})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.headers["content-type"].startswith("application/json")
    assert SHAPES[path](r.json()), r.text


@pytest.mark.parametrize(("status", "text"), [
    (408, "Request 9d2c timed out after 600.0s."),
    (503, "Request 9d2c failed because deployment GatewayIngress in app gateway is overloaded."),
    (429, "Too many requests"),
])
async def test_plain_text_errors_become_json_without_the_proxys_text(status, text):
    async with _client(_plain(status, text)) as c:
        r = await c.post("/v1/completions", json={})
    assert r.status_code == status
    body = r.json()
    assert body["error"]["code"] == status
    assert "9d2c" not in r.text and "GatewayIngress" not in r.text
    assert ("retry-after" in r.headers) == (status in (429, 503))


async def test_an_exception_in_the_proxy_is_a_503_without_its_text():
    async with _client(_raising) as c:
        r = await c.post("/v1/completions", json={})
    assert r.status_code == 503
    assert "10.0.0.5" not in r.text and "7f3a" not in r.text
    assert r.json()["error"]["code"] == 503


async def test_answers_from_the_app_pass_through_unchanged():
    async def json_error(scope, receive, send):
        await JSONResponse({"error": {"message": "bad", "code": 400}}, status_code=400)(
            scope, receive, send)

    async def stream(scope, receive, send):
        async def chunks():
            yield b"data: 1\n\n"
            yield b"data: [DONE]\n\n"
        await StreamingResponse(chunks(), media_type="text/event-stream")(scope, receive, send)

    async with _client(json_error) as c:
        r = await c.post("/v1/completions", json={})
    assert (r.status_code, r.json()) == (400, {"error": {"message": "bad", "code": 400}})
    async with _client(stream) as c:
        r = await c.post("/v1/completions", json={})
    assert (r.status_code, r.text) == (200, "data: 1\n\ndata: [DONE]\n\n")
    async with _client(_plain(200, "# HELP metrics")) as c:
        r = await c.get("/metrics")
    assert (r.status_code, r.text) == (200, "# HELP metrics")


async def test_the_proxys_own_endpoints_are_left_alone():
    async with _client(_plain(503, "This node is being drained.")) as c:
        r = await c.get("/-/healthz")
    assert (r.status_code, r.text) == (503, "This node is being drained.")


async def test_aicis_plain_text_errors_pass_and_the_proxys_own_become_aicis_shape():
    from protocols.aici.errors import route_error

    async def aici_error(scope, receive, send):
        await route_error(400, "uploading Wasm controllers is not supported")(scope, receive,
                                                                              send)

    async with _client(aici_error) as c:
        r = await c.post("/v1/controllers", content=b"\0asm")
    assert (r.status_code, r.text) == (400, "APIError: uploading Wasm controllers is not "
                                            "supported")
    async with _client(_plain(503, "Request 9d2c failed: GatewayIngress overloaded")) as c:
        r = await c.post("/v1/run", json={})
    assert r.status_code == 503 and r.text.startswith("APIError: ") and "9d2c" not in r.text
    async with _client(_silent) as c:
        r = await c.get("/v1/controllers/tags")
    assert r.status_code == 503 and r.text.startswith("APIError: ") and "stopped" in r.text


def test_serve_accepts_what_the_callback_returns():
    from ray.serve._private.http_util import validate_http_proxy_callback_return

    returned = middlewares()
    assert validate_http_proxy_callback_return(returned) == returned
    assert all(isinstance(m, Middleware) for m in returned)


def test_in_serves_stack_the_error_shaping_is_outermost():
    """Serve wraps its app in the list's order: the last is outermost, and the shaping must see
    what the gate answers (the gate's own failure included)."""
    from ray.serve._private.http_util import _apply_middlewares

    from gateway.edge.proxy import ProxyGate

    app = _apply_middlewares(_silent, middlewares())
    assert isinstance(app, ProxyErrorShape) and isinstance(app.app, ProxyGate)


async def test_serves_client_gone_status_passes_without_shaping():
    # Serve's direct ingress answers 499 once the client has left (CI logged a ValueError from
    # shaping it: 499 is no HTTPStatus); nobody reads it, so it is passed on as it is.
    async with _client(_plain(499, "")) as c:
        r = await c.post("/v1/completions", json={})
    assert r.status_code == 499


def test_an_openai_error_body_for_a_status_http_does_not_name():
    from protocols.openai.errors import error_body

    assert error_body(499, "gone")["error"] == {"message": "gone", "type": "error",
                                                "param": None, "code": 499}


async def test_one_request_id_reaches_the_client():
    """Serve's proxy and the replica both write ``x-request-id`` (the same id)."""
    async def twice(scope, receive, send):
        response = JSONResponse({"ok": True})
        response.headers.append("x-request-id", "abc")
        response.headers.append("X-Request-ID", "abc")
        await response(scope, receive, send)

    async with _client(twice) as client:
        answer = await client.get("/v1/models")
    assert answer.headers.get_list("x-request-id") == ["abc"] and answer.json() == {"ok": True}

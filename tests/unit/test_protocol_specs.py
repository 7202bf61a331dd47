"""Protocols as plug-ins: the gateway mounts the enabled specs, and the protocol that owns a path
renders its route-level errors (unknown route, wrong method, missing key, unexpected failure)."""

from __future__ import annotations

import re

import httpx
import msgspec
import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from engines.kit.embedded import EMBEDDED_MODEL_NAME
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from protocols.catalog import PROTOCOLS, load_spec
from tests.fake_engine import FakeEngine

BODY = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}


def _client(engine=None, **config) -> httpx.AsyncClient:
    app = create_app(ModelRegistry({"fake-model": engine or FakeEngine()}), GatewayConfig(**config))
    # Starlette re-raises after sending a 500; the client must still see that 500.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://gw")


def test_every_catalogued_protocol_has_a_spec_of_that_name():
    for name in PROTOCOLS:
        spec = load_spec(name)
        assert spec.name == name and spec.routers and spec.listing


@pytest.mark.parametrize("name", [n for n in PROTOCOLS if load_spec(n).options is not None])
def test_a_protocols_options_come_from_the_gateway_config_key_each_field_names(name):
    kind = load_spec(name).options
    fields = msgspec.structs.fields(kind)
    keys = {f.name for f in msgspec.structs.fields(GatewayConfig)}
    assert fields and all(f.encode_name in keys for f in fields), (name, fields)
    # the same defaults on both sides: an options struct made directly is the configured one
    assert GatewayConfig().options_for(kind) == kind()
    changed = {f.encode_name: _other_value(f.default) for f in fields}
    got = GatewayConfig(**changed).options_for(kind)
    assert [getattr(got, f.name) for f in fields] == list(changed.values())


def _other_value(default):
    """A valid value unlike ``default`` for every options field type there is."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + 1
    return {None: EMBEDDED_MODEL_NAME, "jsonlines": "sse"}[default]  # a served model


@pytest.mark.parametrize("protocols", [["nope"], [], ["openai", "openai"]])
def test_protocol_lists_are_validated(protocols):
    with pytest.raises(ValueError, match="protocols must be distinct names"):
        GatewayConfig(protocols=protocols)


async def test_only_enabled_protocols_are_mounted():
    async with _client(protocols=["mindie", "openai"]) as c:
        listing = (await c.get("/")).json()["protocols"]
        assert list(listing) == ["mindie", "openai"]
        r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == "He"
        r = await c.post("/v2/models/fake-model/generate", json={"text_input": "Hi"})
        assert r.status_code == 200
        # TGI is off: /generate is nobody's, so it gets the first enabled protocol's shape
        r = await c.post("/generate", json=BODY)
        assert r.status_code == 404 and r.json() == {"error": "Not Found",
                                                     "error_type": "NotFoundError"}
        r = await c.post("/invocations", json=BODY)
        assert r.status_code == 404 and set(r.json()) == {"error", "error_type"}


def test_lmtp_is_not_served_when_disabled():
    app = create_app(ModelRegistry({"fake-model": FakeEngine()}),
                     GatewayConfig(protocols=["openai"]))
    with TestClient(app) as client, pytest.raises(WebSocketDisconnect):
        with client.websocket_connect("/lmtp") as ws:
            ws.receive_text()


async def test_a_websocket_only_gateway_still_answers_http_errors():
    async with _client(protocols=["lmtp"]) as c:
        r = await c.get("/v1/models")
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


@pytest.mark.parametrize("method, path, body, shape", [
    ("GET", "/v1/models", None, {"error"}),
    ("POST", "/invocations", BODY, {"code", "type", "message"}),
    ("POST", "/generate", BODY, {"error", "error_type"}),
    ("POST", "/v2/models/fake-model/generate", {"text_input": "Hi"}, {"error", "error_type"}),
])
async def test_a_missing_key_is_refused_in_the_paths_protocol_shape(method, path, body, shape):
    async with _client(api_key="k") as c:
        r = await c.request(method, path, json=body)
        assert r.status_code == 401 and set(r.json()) == shape
        r = await c.request(method, path, json=body, headers={"authorization": "Bearer k"})
        assert r.status_code == 200


async def test_with_a_key_probes_stay_open_and_metrics_need_it():
    async with _client(api_key="k") as c:
        for path in ("/health", "/version", "/ping", "/v2/health/live", "/v2/health/ready"):
            assert (await c.get(path)).status_code == 200, path
        assert (await c.get("/metrics")).status_code == 401
        metrics = await c.get("/metrics", headers={"authorization": "Bearer k"})
        assert metrics.status_code == 200
    # The replica's own HTTP series count what the key check refused too (one middleware
    # records them and the cluster's series alike).
    assert 'gateway_http_requests_total{path="/metrics",status="401"}' in metrics.text


class _Broken(FakeEngine):
    async def check_health(self) -> None:
        raise RuntimeError("boom")

    async def tokenize(self, prompt):
        raise RuntimeError("boom")


@pytest.mark.parametrize("path, body, expected", [
    ("/tokenize", {"prompt": "Hi"}, {"type": "InternalServerError", "param": None, "code": 500}),
    ("/invocations", {"inputs": "Hi", "parameters": {"truncate": 1}}, None),
    ("/generate", {"inputs": "Hi", "parameters": {"truncate": 1}}, None),
])
async def test_unexpected_failures_are_500s_or_engine_errors_in_shape(path, body, expected):
    async with _client(_Broken()) as c:
        r = await c.post(path, json=body)
    if expected is not None:  # an incident id to find it in the log, no exception text
        error = r.json()["error"]
        assert r.status_code == 500 and {k: error[k] for k in expected} == expected
        assert re.fullmatch(r"internal error \(incident [0-9a-f]{12}; the gateway's log has "
                            r"the details\)", error["message"]), error
        assert "RuntimeError" not in r.text and "boom" not in r.text
    else:  # the protocol turned the failure into its own engine error first
        # ... and without the exception's text, which may carry addresses and traces.
        assert r.status_code == 424 and "tokenize failed" in r.text and "boom" not in r.text


async def test_engine_kind_is_reported_where_protocols_name_the_backend():
    async with _client() as c:
        meta = (await c.get("/v2/models/fake-model")).json()
        assert meta["platform"] == "fake"
        r = await c.post("/generate", json=BODY)
        assert r.headers["x-compute-type"] == "fake"
        assert (await c.get("/gateway/engines")).json() == {
            "fake-model": {"active": 0, "aborted": 0, "started": 1}}

"""Request bodies over ``max_request_bytes`` get a 413 in each protocol's own error shape."""

import asyncio
import json

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.ingress import limits
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from protocols.openai.errors import error_body
from tests.fake_engine import FakeEngine

LIMIT = 1000
PADDING = "x" * 2000


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine):
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig(max_request_bytes=LIMIT))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as c:
        yield c


async def _chunks(data: bytes):
    """A body without Content-Length (chunked), so only the byte count can trip the limit."""
    for start in range(0, len(data), 256):
        yield data[start:start + 256]


BODIES = {
    "/v1/completions": {"model": "fake-model", "prompt": PADDING, "max_tokens": 2},
    "/invocations": {"inputs": PADDING, "parameters": {"max_new_tokens": 2}},
    "/predictions/fake-model": {"inputs": PADDING},
    "/generate": {"inputs": PADDING},
    "/generate_stream": {"inputs": PADDING},
    "/": {"inputs": PADDING},
    "/v2/models/fake-model/generate_stream": {"text_input": PADDING},
}
MESSAGE = f"Request body exceeds the limit of {LIMIT} bytes."


def _expected(path: str) -> dict:
    if path.startswith("/v1/"):
        return error_body(413, MESSAGE)
    if path.startswith(("/invocations", "/predictions/")):
        return {"code": 413, "type": "ServiceException", "message": MESSAGE}
    if path.startswith("/v2/"):
        return {"error": MESSAGE, "error_type": "Input Validation Error"}
    return {"error": MESSAGE, "error_type": "validation"}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", list(BODIES))
async def test_oversized_body_is_413_in_the_protocol_shape(client, engine, path, chunked):
    data = json.dumps(BODIES[path]).encode()
    assert len(data) > LIMIT
    content = _chunks(data) if chunked else data
    r = await client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json() == _expected(path)
    assert engine.requests == []  # refused before anything reached the engine


async def test_body_under_the_limit_is_served(client, engine):
    data = json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).encode()
    r = await client.post("/invocations", content=_chunks(data))
    assert r.status_code == 200 and r.json() == {"generated_text": "He"}
    assert len(engine.requests) == 1


async def test_a_refused_body_does_not_affect_the_next_request(client):
    big = await client.post("/generate", content=json.dumps({"inputs": PADDING}))
    small = await client.post("/generate", json={"inputs": "Hi",
                                                 "parameters": {"max_new_tokens": 2}})
    assert big.status_code == 413 and small.status_code == 200
    assert small.json()["generated_text"] == "He"


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="max_request_bytes"):
        GatewayConfig(max_request_bytes=0)


class _Upload:
    """A request body in 256-byte chunks that counts what the server pulled of it."""

    def __init__(self, data: bytes, stall_after: int | None = None):
        self.chunks = [data[start:start + 256] for start in range(0, len(data), 256)]
        self.stall_after, self.pulled = stall_after, 0

    async def __aiter__(self):
        for chunk in self.chunks:
            if self.pulled == self.stall_after:
                await asyncio.Event().wait()  # the client stops sending, connection open
            self.pulled += 1
            yield chunk


def _big_body() -> bytes:
    return json.dumps({"inputs": "x" * 40 * LIMIT}).encode()


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_the_rest_of_a_refused_body_is_read_before_the_413(client, declared):
    """So a client still uploading reads the 413 instead of a connection reset under it."""
    data = _big_body()
    upload = _Upload(data)
    headers = {"content-length": str(len(data))} if declared else {}
    r = await client.post("/generate", content=upload, headers=headers)
    assert r.status_code == 413 and r.json() == _expected("/generate")
    assert upload.pulled == len(upload.chunks)


async def test_a_body_past_the_drain_bound_is_refused_without_reading_it(client, monkeypatch):
    monkeypatch.setattr(limits, "DRAIN_BYTES", 10 * LIMIT)
    data = _big_body()
    upload = _Upload(data)
    r = await client.post("/generate", content=upload, headers={"content-length": str(len(data))})
    assert r.status_code == 413 and r.json() == _expected("/generate")
    assert upload.pulled <= 1  # not read beyond what the transport hands over with the headers

    upload = _Upload(data)  # undeclared: read up to the bound, then refused
    r = await client.post("/generate", content=upload)
    assert r.status_code == 413
    assert LIMIT // 256 < upload.pulled < len(upload.chunks)


async def test_a_stalled_upload_still_gets_its_413(client, monkeypatch):
    monkeypatch.setattr(limits, "DRAIN_S", 0.2)
    data = _big_body()
    upload = _Upload(data, stall_after=10)
    r = await asyncio.wait_for(
        client.post("/generate", content=upload, headers={"content-length": str(len(data))}), 30)
    assert r.status_code == 413 and upload.pulled == 10

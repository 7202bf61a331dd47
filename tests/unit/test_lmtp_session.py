"""LMTP websocket sessions over the fake engine (raw frames, Starlette's test client)."""

import json

import pytest
from starlette.testclient import TestClient

from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from tests.fake_engine import FakeEngine


@pytest.fixture
def app_client():
    app = create_app(ModelRegistry({"fake-model": FakeEngine(reply="abc")}), GatewayConfig())
    with TestClient(app) as client:
        yield client


def _items(ws, stream_id, until_end=True):
    """Read frames until the stream ends (finish_reason or error); return its items."""
    out = []
    while True:
        kind, _, body = ws.receive_text().partition(" ")
        for item in json.loads(body):
            if item.get("stream_id") != stream_id:
                continue
            out.append((kind, item))
            if item.get("error") is not None or item.get("finish_reason") is not None:
                return out
            if kind == "MSG":
                return out


def _send(ws, command, payload):
    ws.send_text(f"{command} {json.dumps(payload)}")


@pytest.mark.parametrize("path", ["/", "/lmtp"])
def test_generate_streams_tokens(app_client, path):
    with app_client.websocket_connect(path) as ws:
        _send(ws, "GENERATE", {"model": "fake-model", "prompt": [72, 105], "stream_id": 1,
                               "max_tokens": 2})
        items = [i for _, i in _items(ws, 1)]
        assert [i["token"] for i in items] == [ord("a"), ord("b")]
        assert [i["finish_reason"] for i in items] == [None, "length"]
        assert all(str(i["token"]) in i["top_logprobs"] for i in items)


def test_eos_finishes_with_stop(app_client):
    with app_client.websocket_connect("/") as ws:
        _send(ws, "GENERATE", {"model": "fake-model", "prompt": [1], "stream_id": 5})
        items = [i for _, i in _items(ws, 5)]
        assert [i["token"] for i in items] == [97, 98, 99, 0]
        assert items[-1]["finish_reason"] == "stop"


def test_interleaved_streams_keep_their_ids_and_types(app_client):
    with app_client.websocket_connect("/") as ws:
        _send(ws, "GENERATE", {"model": "fake-model", "prompt": [1], "stream_id": 1000,
                               "max_tokens": 3})
        _send(ws, "GENERATE", {"model": "fake-model", "prompt": [1], "stream_id": "x",
                               "max_tokens": 3})
        seen = {1000: [], "x": []}
        while any(not v or v[-1]["finish_reason"] is None for v in seen.values()):
            kind, _, body = ws.receive_text().partition(" ")
            assert kind == "TOKEN"
            for item in json.loads(body):
                seen[item["stream_id"]].append(item)
        assert all(len(v) == 3 for v in seen.values())


def test_score(app_client):
    with app_client.websocket_connect("/") as ws:
        _send(ws, "SCORE", {"model": "fake-model", "prompt": [1, 2], "scored": [3, 4, 5],
                            "stream_id": 2})
        items = [i for _, i in _items(ws, 2)]
        assert [i["token"] for i in items] == [3, 4, 5]
        assert [i["logprob"] for i in items] == [-2.0, -3.0, -4.0]
        assert [i["finish_reason"] for i in items] == [None, None, "stop"]
        assert all("top_logprobs" not in i for i in items)


def test_model_info(app_client):
    with app_client.websocket_connect("/") as ws:
        _send(ws, "MODEL_INFO", {"model": "fake-model", "stream_id": 9,
                                 "data": {"model": "fake-model"}})
        [(kind, item)] = _items(ws, 9)
        assert kind == "MSG" and item["model_info"]["model"] == "fake-model"


@pytest.mark.parametrize("payload", [
    {"model": "nope", "prompt": [1]},
    {"model": "fake-model", "prompt": []},
    {"model": "fake-model", "prompt": [1], "max_tokens": 0},
    {"model": "fake-model", "prompt": [1], "max_tokens": 10_000},
    {"model": "fake-model", "prompt": [1], "foo": 1},
    {"model": "fake-model"},
    {"prompt": [1]},
])
def test_errors_are_token_items_and_connection_survives(app_client, payload):
    with app_client.websocket_connect("/") as ws:
        _send(ws, "GENERATE", {**payload, "stream_id": 1})
        [(kind, item)] = _items(ws, 1)
        assert kind == "TOKEN" and isinstance(item["error"], str) and item["error"]
        _send(ws, "GENERATE", {"model": "fake-model", "prompt": [1], "stream_id": 2,
                               "max_tokens": 1})
        assert _items(ws, 2)[-1][1]["finish_reason"] == "length"


def test_score_with_empty_scored_is_an_error(app_client):
    with app_client.websocket_connect("/") as ws:
        _send(ws, "SCORE", {"model": "fake-model", "prompt": [1], "scored": [], "stream_id": 4})
        [(kind, item)] = _items(ws, 4)
        assert kind == "TOKEN" and "scored" in item["error"]


def test_unknown_command_and_malformed_frames(app_client):
    with app_client.websocket_connect("/") as ws:
        _send(ws, "FOO", {"stream_id": 3})
        [(kind, item)] = _items(ws, 3)
        # TOKEN, not MSG: LMQL reads a stream's errors only from TOKEN items.
        assert kind == "TOKEN" and item["error"] == "Unknown command: FOO"
        ws.send_text("GARBAGE")
        [(kind, item)] = _items(ws, None)
        assert kind == "MSG" and "malformed" in item["error"]
        ws.send_text('GENERATE {"stream_id": 8, "prompt": [1,')
        [(kind, item)] = _items(ws, 8)
        assert kind == "TOKEN" and "JSON" in item["error"]
        _send(ws, "GENERATE", {"model": "fake-model", "prompt": [1], "stream_id": 9,
                               "max_tokens": 1})
        assert _items(ws, 9)[-1][1]["finish_reason"] == "length"


def test_plain_http_root_still_works(app_client):
    body = app_client.get("/").json()
    assert body["models"] == ["fake-model"]


def test_disconnect_cancels_the_connections_engine_requests():
    import time

    engine = FakeEngine(reply="abc", delay=0.05)
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig())
    with TestClient(app) as client:
        with client.websocket_connect("/") as ws:
            for sid in (1, 2):
                _send(ws, "GENERATE", {"model": "fake-model", "prompt": [1], "stream_id": sid,
                                       "max_tokens": 40})
            ws.receive_text()  # streams are running
        deadline = time.monotonic() + 5
        while len(engine.cancelled) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(engine.cancelled) == 2 and not engine.active


def test_pathological_frames_do_not_close_the_connection(app_client):
    with app_client.websocket_connect("/") as ws:
        ws.send_text('GENERATE {"stream_id": 2, "prompt": [' + "1" * 5000 + "]}")
        [(kind, item)] = _items(ws, 2)
        assert kind == "TOKEN" and item["error"]
        ws.send_text("GENERATE " + "[" * 50_000 + "]" * 50_000)
        [(kind, item)] = _items(ws, None)
        assert kind == "MSG" and item["error"]
        _send(ws, "GENERATE", {"model": "fake-model", "prompt": [1], "stream_id": 3,
                               "max_tokens": 1})
        assert _items(ws, 3)[-1][1]["finish_reason"] == "length"

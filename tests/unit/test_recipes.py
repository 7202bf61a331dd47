"""The recipes of docs/extending.md, followed step by step and nothing else: a toy protocol
(``tests/recipes/toy_protocol``) and a toy engine kind (``tests/recipes/toy_kind``), registered
as the recipes say and served by the real gateway app and the real engine host."""

from __future__ import annotations

import anthropic
import httpx
import httpx2
import openai
import pytest

from contract import ErrorEvent, FinalEvent, GenerateRequest, Sampling, TextPrompt, TokenEvent
from engines.kit import kinds
from engines.kit.config import ModelConfig
from engines.replica.host import EngineHost
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from protocols import catalog
from tests.fake_engine import FakeEngine


@pytest.fixture
def toy_protocol(monkeypatch):
    """"Add a protocol", step 4: one entry in PROTOCOLS."""
    monkeypatch.setitem(catalog.PROTOCOLS, "toy", "tests.recipes.toy_protocol.spec")


@pytest.fixture
def toy_kind(monkeypatch, tmp_path):
    """"Add an engine kind", step 2: one entry in ENGINE_KINDS; a model entry says
    ``engine: toy``."""
    monkeypatch.setitem(kinds.ENGINE_KINDS, "toy", kinds.EngineKind(
        implementation="tests.recipes.toy_kind.engine:ToyEngine",
        concurrency_arg="max_sequences", default_concurrency=4))
    return ModelConfig(name="toy", engine="toy", source=str(tmp_path),
                       engine_args={"step_s": 0.01})


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


async def test_a_toy_protocol_is_mounted_and_answers_in_its_own_shape(toy_protocol):
    config = GatewayConfig(request_timeout_s=30)  # its options: a GatewayConfig key (step 3)
    assert "toy" in config.protocols  # mounted by default once registered
    app = create_app(ModelRegistry({"fake-model": FakeEngine()}), config)
    async with _client(app) as http:
        whole = await http.post("/toy/generate", json={"text": "Hi", "max_tokens": 5})
        streamed = await http.post("/toy/generate", json={"text": "Hi", "stream": True,
                                                                  "max_tokens": 20})
        refused = await http.post("/toy/generate", json={"text": "x" * 100})  # over 64 tokens
        unknown = await http.post("/toy/generate", json={"text": "Hi", "model": "nope"})
        route = await http.get("/toy/nothing-here")
        listing = (await http.get("/")).json()["protocols"]
    assert whole.json() == {"text": "Hello", "finish_reason": "length"}
    assert streamed.text.splitlines()[-1] == "end: eos" and "token: H" in streamed.text
    assert refused.status_code == 400 and "toy_error" in refused.json()  # an ErrorEvent, step 2
    assert unknown.status_code == 404 and "nope" in unknown.json()["toy_error"]
    assert route.status_code == 404 and "toy_error" in route.json()  # route_error, step 3
    assert listing["toy"] == "POST /toy/generate"


async def test_a_toy_engine_kind_is_hosted_and_keeps_the_stream_contract(toy_kind):
    host = EngineHost.for_model(toy_kind)  # step 3: the host comes for free
    events = [e async for e in host.generate(GenerateRequest(
        request_id="a", model="toy", prompt=TextPrompt(text="abc"), sampling=Sampling(n=1)))]
    assert [e.text for e in events if isinstance(e, TokenEvent)] == ["c", "b", "a", ""]
    assert isinstance(events[-1], FinalEvent) and events[-1].finish_reason == "eos"
    bad = [e async for e in host.generate(GenerateRequest(
        request_id="b", model="toy", prompt=TextPrompt(text="a\0b")))]
    assert len(bad) == 1 and isinstance(bad[0], ErrorEvent) and bad[0].kind == "validation"
    late = [e async for e in host.generate(GenerateRequest(
        request_id="c", model="toy", prompt=TextPrompt(text="abcdefgh" * 8), timeout_s=0.05))]
    assert late[-1].finish_reason == "abort"  # the host's deadline, on any kind


async def test_a_toy_engine_kind_serves_the_protocols_clients(toy_kind):
    host = EngineHost.for_model(toy_kind)
    app = create_app(ModelRegistry({"toy": host}), GatewayConfig())
    client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x", max_retries=0,
                                http_client=httpx.AsyncClient(
                                    transport=httpx.ASGITransport(app=app),
                                    base_url="http://gw/v1"))
    out = await client.completions.create(model="toy", prompt="olleh", max_tokens=10)
    assert out.choices[0].text == "hello" and out.choices[0].finish_reason == "stop"
    async with _client(app) as http:
        tgi = await http.post("/generate", json={"inputs": "ab", "parameters": {}})
    assert tgi.json()["generated_text"] == "ba"
    claude = anthropic.AsyncAnthropic(base_url="http://gw", api_key="x", max_retries=0,
                                      http_client=httpx2.AsyncClient(
                                          transport=httpx2.ASGITransport(app=app)))
    message = await claude.messages.create(model="toy", max_tokens=10,
                                           messages=[{"role": "user", "content": "iH"}])
    assert message.content[0].text == "Hi" and message.stop_reason == "end_turn"

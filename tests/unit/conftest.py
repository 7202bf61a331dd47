import httpx
import openai
import pytest

from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from tests import fake_engine
from tests.fake_engine import FakeEngine
from tests.pipeline_models import build_tiny
from tests.recorded_metrics import Recorded


@pytest.fixture
def recorded() -> Recorded:
    """A recording stand-in for ``ray.util.metrics``; ``recorded.keeper.refresh()`` hands
    the levels over, as the levels' thread does every second."""
    return Recorded()


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine):
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random-weight Llama (6 layers) with the embedded model's tokenizer, built once."""
    from engines.kit.embedded import prepare_embedded_model

    return build_tiny("llama", tmp_path_factory.mktemp("tiny"),
                      prepare_embedded_model(progress=False))


@pytest.fixture
def long_context(monkeypatch):
    """The fake engine's context widened from 64 to 2048 tokens: room for tool definitions
    and call markup."""
    monkeypatch.setattr(fake_engine, "MAX_MODEL_LEN", 2048)


@pytest.fixture
def openai_on_fake():
    """``make(reply, controllers)``: the openai SDK over an in-process gateway whose one model
    (``fake-model``) is a fake engine answering ``reply``; returns the client and the engine."""
    def make(reply: str = "Hello world", controllers: str = "splice"):
        engine = FakeEngine(reply=reply, controllers=controllers)
        app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig())
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw/v1")
        return openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x", http_client=http,
                                  max_retries=0), engine
    return make

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.registry import ModelRegistry
from tests.fake_engine import FakeEngine
from tests.pipeline_models import build_tiny


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
    from engines.embedded import prepare_embedded_model

    return build_tiny("llama", tmp_path_factory.mktemp("tiny"),
                      prepare_embedded_model(progress=False))

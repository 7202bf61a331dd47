import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.registry import ModelRegistry
from tests.fake_engine import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine):
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c

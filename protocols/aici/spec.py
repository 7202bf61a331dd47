"""AICI's REST API as the gateway mounts it (``/v1/models`` is the OpenAI protocol's, which
answers AICI's clients in the same shape)."""

from protocols.aici.errors import route_error
from protocols.aici.routes import router
from protocols.spec import ProtocolSpec

SPEC = ProtocolSpec(name="aici", routers=(router,), listing="/v1/run", route_error=route_error,
                    paths=frozenset({"/v1/run", "/v1/controllers"}),
                    prefixes=("/v1/controllers/",))

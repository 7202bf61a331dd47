"""OpenAI's Responses API as the gateway mounts it: its own package, OpenAI's error envelope."""

from protocols.openai.errors import route_error
from protocols.responses.routes import router
from protocols.spec import ProtocolSpec

SPEC = ProtocolSpec(name="responses", routers=(router,), listing="/v1/responses",
                    route_error=route_error, paths=frozenset({"/v1/responses"}),
                    model_in_body=frozenset({"/v1/responses"}))

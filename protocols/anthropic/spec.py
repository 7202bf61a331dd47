"""Anthropic's Messages API as the gateway mounts it."""

from protocols.anthropic.errors import route_error
from protocols.anthropic.routes import router
from protocols.spec import ProtocolSpec

_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

SPEC = ProtocolSpec(name="anthropic", routers=(router,), listing="/v1/messages",
                    route_error=route_error, paths=_PATHS, model_in_body=_PATHS)

"""Hugging Face TGI's own routes as the gateway mounts them."""

from protocols.spec import ProtocolSpec
from protocols.tgi.errors import route_error
from protocols.tgi.routes import TGIOptions, router

SPEC = ProtocolSpec(name="tgi", routers=(router,), listing="POST /  /generate  /generate_stream",
                    route_error=route_error,
                    paths=frozenset({"/", "/generate", "/generate_stream", "/info"}),
                    options=TGIOptions)

"""MindIE / Triton v2 generate as the gateway mounts it."""

from protocols.mindie.errors import route_error
from protocols.mindie.routes import router
from protocols.spec import ProtocolSpec

SPEC = ProtocolSpec(name="mindie", routers=(router,),
                    listing="/v2/models/{model}/generate[_stream]", route_error=route_error,
                    prefixes=("/v2/",))

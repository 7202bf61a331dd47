"""MindIE / Triton v2 generate as the gateway mounts it."""

from protocols.mindie.errors import route_error
from protocols.mindie.routes import MindIEOptions, router
from protocols.spec import ProtocolSpec

SPEC = ProtocolSpec(name="mindie", routers=(router,),
                    listing="/v2/models/{model}/generate[_stream]", route_error=route_error,
                    prefixes=("/v2/",),
                    # KServe liveness/readiness probes: orchestrators send no API key.
                    public_paths=frozenset({"/v2/health/live", "/v2/health/ready"}),
                    options=MindIEOptions, model_in_path=("/v2/models/",))

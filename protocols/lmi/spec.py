"""SageMaker / DJL LMI as the gateway mounts it."""

from protocols.lmi.errors import route_error
from protocols.lmi.routes import LMIOptions, router
from protocols.spec import ProtocolSpec

SPEC = ProtocolSpec(name="lmi", routers=(router,), listing="/invocations  /predictions/{model}",
                    route_error=route_error,
                    prefixes=("/invocations", "/predictions/", "/models/"),
                    public_paths=frozenset({"/ping"}), options=LMIOptions,
                    model_in_path=("/predictions/", "/models/"))

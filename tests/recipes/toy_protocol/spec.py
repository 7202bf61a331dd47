"""Step 3 of docs/extending.md "Add a protocol": the spec the gateway mounts."""

from protocols.spec import ProtocolSpec
from tests.recipes.toy_protocol.errors import route_error
from tests.recipes.toy_protocol.routes import ToyOptions, router

SPEC = ProtocolSpec(name="toy", routers=(router,), listing="POST /toy/generate",
                    route_error=route_error, prefixes=("/toy/",),
                    model_in_body=frozenset({"/toy/generate"}), options=ToyOptions)

"""The OpenAI protocol as the gateway mounts it."""

from protocols.openai.batches import batch_router
from protocols.openai.errors import route_error
from protocols.openai.routes import OpenAIOptions, router
from protocols.spec import ProtocolSpec

SPEC = ProtocolSpec(name="openai", routers=(router, batch_router), listing="/v1", route_error=route_error,
                    paths=frozenset({"/tokenize", "/detokenize"}), prefixes=("/v1/",),
                    options=OpenAIOptions,
                    model_in_body=frozenset({"/v1/completions", "/v1/chat/completions",
                                             "/tokenize", "/detokenize"}))

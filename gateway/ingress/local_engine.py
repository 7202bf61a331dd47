"""A model's engine inside the ingress replica itself (``ModelConfig.colocated``, and a
model's own application's replicas).

Tokens then go from the engine to the protocol encoders in the same event loop: no Ray call
per streamed batch, no msgpack round trip, no second process touching every token. The bounds
every engine client of the process gets (``gateway.ingress.bounds``) wrap it as they wrap the
Serve path's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from contract import Event, GenerateRequest
from engines.kit.config import ModelConfig
from engines.replica.host import EngineHost
from gateway.ingress.registry import EngineWrapper

__all__ = ["LocalEngineClient"]


class LocalEngineClient(EngineWrapper):
    """:class:`contract.EngineClient` over an :class:`EngineHost` in this process."""

    def __init__(self, host: EngineHost, model: str, *,
                 on_request: Callable[[GenerateRequest], None] | None = None):
        super().__init__(host)  # tokenize, model_info, stats, ...: the host's own
        self.host = host
        self.model = model
        self.on_request = on_request  # told of each generation admitted (prefix routing's record)

    @classmethod
    def start(cls, config: ModelConfig, **options) -> LocalEngineClient:
        return cls(EngineHost.for_model(config), config.name, **options)

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """The host's own stream (closing it, a client gone, aborts the request): no hop of
        its own, as every event of the model's replicas passes here."""
        if self.on_request is not None:
            self.on_request(request)
        return self.host.generate(request)

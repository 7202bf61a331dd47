"""A model's engine inside the ingress replica itself (``ModelConfig.colocated``).

Tokens then go from the engine to the protocol encoders in the same event loop: no Ray call
per streamed batch, no msgpack round trip, no second process touching every token. What the
Serve path adds on top of the engine contract applies here too: the default deadline and the
bound on generations in flight (beyond it: refused as overloaded at once).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from contextvars import ContextVar

from contract import EngineStats, Event, GenerateRequest, ModelInfo, Prompt
from engines.kit.config import ModelConfig
from engines.replica.host import EngineHost
from gateway.ingress.engine_client import overloaded, with_default_deadline

__all__ = ["CloseStreamsWithRequest", "LocalEngineClient"]


class _Opened:
    """A generation an HTTP request started on an engine in this process."""

    __slots__ = ("abandoned", "events")

    def __init__(self) -> None:
        self.abandoned = False
        self.events: AsyncGenerator[Event, None] | None = None


# The generations the current HTTP request started (set by CloseStreamsWithRequest).
_STARTED: ContextVar[list[_Opened] | None] = ContextVar("llm_gateway_started", default=None)


class CloseStreamsWithRequest:
    """ASGI middleware: when an HTTP request's response is over, the generations it started on
    an engine in this process are closed, which aborts any still running.

    A protocol that ends a stream itself (an OpenAI stream cannot show a backtrack: it ends
    with an error there) stops reading the engine's events without closing them; only garbage
    collection would, and in a replica that runs vLLM it did not (the e2e suite found one
    request running on for minutes). A generation some other task is reading at that moment
    (a merge of several prompts' streams) is marked, and ends at its next event."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started: list[_Opened] = []
        token = _STARTED.set(started)
        try:
            await self.app(scope, receive, send)
        finally:
            _STARTED.reset(token)
            for opened in started:
                opened.abandoned = True
                events = opened.events
                if events is not None and not events.ag_running:  # else: at its next event
                    await events.aclose()


class LocalEngineClient:
    """:class:`contract.EngineClient` over an :class:`EngineHost` in this process."""

    def __init__(self, host: EngineHost, model: str, *, request_timeout_s: float | None = None,
                 max_pending: int | None = None,
                 on_request: Callable[[GenerateRequest], None] | None = None):
        self.host = host
        self.model = model
        self.request_timeout_s = request_timeout_s
        self.max_pending = max_pending
        self.pending = 0
        self.on_request = on_request  # told of each generation admitted (prefix routing's record)

    @classmethod
    def start(cls, config: ModelConfig, **options) -> LocalEngineClient:
        return cls(EngineHost.for_model(config), config.name, **options)

    def generate(self, request: GenerateRequest) -> AsyncGenerator[Event, None]:
        opened = _Opened()
        opened.events = self._generate(request, opened)
        started = _STARTED.get()
        if started is not None:
            started.append(opened)
        return opened.events

    async def _generate(self, request: GenerateRequest, opened: _Opened) -> AsyncIterator[Event]:
        if self.max_pending is not None and self.pending >= self.max_pending:
            yield overloaded(self.model)
            return
        request = with_default_deadline(request, self.request_timeout_s)
        if self.on_request is not None:
            self.on_request(request)
        self.pending += 1
        try:
            # Closing this generator (client gone) closes the host's, which aborts the request.
            async with aclosing(self.host.generate(request)) as events:
                async for event in events:
                    if opened.abandoned:  # its request is over (CloseStreamsWithRequest)
                        return
                    yield event
        finally:
            self.pending -= 1

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        return await self.host.tokenize(prompt)

    async def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return await self.host.detokenize(token_ids)

    async def detokenize_each(self, token_ids: tuple[int, ...]) -> tuple[str, ...]:
        return await self.host.detokenize_each(token_ids)

    async def model_info(self) -> ModelInfo:
        return await self.host.model_info()

    async def check_health(self) -> None:
        await self.host.check_health()

    async def stats(self) -> EngineStats:
        return await self.host.stats()

"""What every engine client of this process gets, whichever way its engine is reached (a Serve
deployment, or an engine in this process): at most ``max_pending`` generations of the model in
flight (beyond: refused as overloaded at once, before any call), the gateway's default
deadline on a request whose protocol set none, and the end of an HTTP request's generations
with its response (:class:`CloseStreamsWithRequest`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from contextvars import ContextVar

import msgspec

from contract import ErrorEvent, Event, GenerateRequest
from contract.client import EngineClient
from gateway.ingress.registry import EngineWrapper

__all__ = ["BoundedEngine", "CloseStreamsWithRequest", "overloaded", "with_default_deadline"]


class BoundedEngine(EngineWrapper):
    """``inner`` under this process's bounds for ``model``."""

    def __init__(self, inner: EngineClient, model: str, *, max_pending: int | None = None,
                 request_timeout_s: float | None = None):
        super().__init__(inner)
        self.model = model
        # The most generations this process sends the model (for a Serve deployment: what its
        # replicas hold plus Serve's queue): the excess is refused here at once. Serve would
        # refuse it too, but only after its router has spent seconds of a saturated event loop
        # on each (2,240 refusals took 4.1 s each at the median under a 2,000-request burst).
        self.max_pending = max_pending
        self.request_timeout_s = request_timeout_s
        self.pending = 0  # generations started here and not yet ended

    def generate(self, request: GenerateRequest) -> AsyncGenerator[Event, None]:
        opened = _Opened()
        opened.events = self._generate(request, opened)
        started = _STARTED.get()
        if started is not None:  # an HTTP request's: closed with its response
            started.append(opened)
        return opened.events

    async def _generate(self, request: GenerateRequest, opened: _Opened) -> AsyncIterator[Event]:
        if self.max_pending is not None and self.pending >= self.max_pending:
            yield overloaded(self.model)
            return
        self.pending += 1
        try:  # closed at once with this one (a client gone): the engine request is aborted
            request = with_default_deadline(request, self.request_timeout_s)
            async with aclosing(self.inner.generate(request)) as events:
                async for event in events:
                    if opened.abandoned:  # its request is over (CloseStreamsWithRequest)
                        return
                    yield event
        finally:
            self.pending -= 1


class _Opened:
    """A generation an HTTP request started."""

    __slots__ = ("abandoned", "events")

    def __init__(self) -> None:
        self.abandoned = False
        self.events: AsyncGenerator[Event, None] | None = None


# The generations the current HTTP request started (set by CloseStreamsWithRequest).
_STARTED: ContextVar[list[_Opened] | None] = ContextVar("llm_gateway_started", default=None)


class CloseStreamsWithRequest:
    """ASGI middleware: when an HTTP request's response is over, the generations it started
    are closed, which aborts any still running.

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


def with_default_deadline(request: GenerateRequest, timeout_s: float | None) -> GenerateRequest:
    """``request`` with the gateway's default deadline where the client set none."""
    if request.timeout_s is None and timeout_s is not None:
        return msgspec.structs.replace(request, timeout_s=timeout_s)
    return request


def overloaded(model: str) -> ErrorEvent:
    return ErrorEvent(kind="overloaded",
                      message=f"model `{model}` has too many requests queued; retry later")

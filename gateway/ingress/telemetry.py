"""What every request did, as series in Ray's metrics system and as a request id in the logs
(docs/observability.md).

:class:`RequestTelemetry` (ASGI middleware) gives each HTTP request or websocket a
:class:`RequestRecord`: its id (the client's ``x-request-id``, or the one Serve's proxy or
HAProxy set, or a new one), sent back in ``x-request-id``; the protocol that serves it; whether
its response streams; why it was refused. :class:`InstrumentedEngine` wraps each model's engine
client and measures every generation for the current record: outcome, tokens, time to first
token and between tokens (for streamed responses: what a client reading the stream sees), and
end-to-end time. The series live in :class:`GatewayMetrics`, one set per process.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from contextvars import ContextVar
from typing import Any

from contract import (
    ErrorEvent,
    Event,
    FinalEvent,
    GenerateRequest,
    TokenEvent,
)
from contract.client import EngineClient
from engines.kit.telemetry import (
    LATENCY_BUCKETS_S,
    LEVELS,
    TOKEN_GAP_BUCKETS_S,
    CountedHistogram,
    Levels,
    ray_metrics,
)
from gateway.ingress import metrics as http_series
from gateway.ingress.registry import EngineWrapper

__all__ = ["CLIENT_ID_PATTERN", "MAX_KEY_LABELS", "GatewayMetrics", "InstrumentedEngine",
           "RequestRecord", "RequestTelemetry", "bounded_label", "current_record",
           "gateway_metrics", "refused_for"]

GENERATION_TAGS = ("model", "protocol", "engine")
ADAPTER_TAGS = ("model", "adapter")
# Adapters named in series, per process: beyond, "other" (a directory of thousands of
# adapters must not make a series each).
MAX_ADAPTER_LABELS = 64
KEY_TAGS = ("key", "model", "protocol")
MAX_KEY_LABELS = 64
# Content types of responses that stream (SSE, JSON lines): TTFT and ITL are measured for these.
STREAM_TYPES = (b"text/event-stream", b"application/jsonlines", b"application/x-ndjson")
# A client's id is kept when it is short and plain (it goes into headers and log lines);
# HAProxy's rules check the same pattern (gateway/edge/haproxy_errors.py).
CLIENT_ID_PATTERN = r"[A-Za-z0-9._:/+=@-]{1,128}"
_CLIENT_ID = re.compile(CLIENT_ID_PATTERN)
# Why a response was refused, by status, when nothing named a reason.
_REASONS = {400: "validation", 401: "unauthorized", 403: "unauthorized", 404: "not_found",
            405: "method_not_allowed", 413: "too_large", 422: "validation", 429: "overloaded",
            503: "unavailable", 504: "timeout", 529: "overloaded"}


class GatewayMetrics:
    """The gateway's series (their names, tags and buckets: docs/observability.md); ``levels``
    keeps the gauges set (Ray forgets a gauge its process stopped setting)."""

    def __init__(self, make: Any, levels: Levels = LEVELS):
        self.levels = levels
        def histogram(name: str, description: str, buckets: tuple[float, ...]) -> Any:
            return make.Histogram(name, description=description, boundaries=list(buckets),
                                  tag_keys=GENERATION_TAGS)

        def counter(name: str, description: str, tags: tuple[str, ...] = GENERATION_TAGS) -> Any:
            return make.Counter(name, description=description, tag_keys=tags)

        self.requests = counter("llm_gateway_requests", "Generations by outcome: a finish "
                                "reason, an error kind, timeout, or aborted (the client left).",
                                (*GENERATION_TAGS, "outcome"))
        self.refusals = counter("llm_gateway_refusals", "Responses with an error status, by "
                                "reason.", ("protocol", "reason", "status"))
        self.prompt_tokens = counter("llm_gateway_prompt_tokens", "Prompt tokens of generations.")
        self.generation_tokens = counter("llm_gateway_generation_tokens",
                                         "Tokens generated (controller-forced ones included).")
        self.forced_tokens = counter("llm_gateway_forced_tokens",
                                     "Tokens a controller appended without sampling.")
        # LoRA adapters apart (docs/adapters.md): the series above count them as their model.
        self.adapter_requests = counter("llm_gateway_adapter_requests", "Generations that ran "
                                        "a LoRA adapter, by outcome.",
                                        (*ADAPTER_TAGS, "outcome"))
        self.adapter_tokens = counter("llm_gateway_adapter_tokens", "Tokens of generations "
                                      "that ran a LoRA adapter (kind: prompt or generated).",
                                      (*ADAPTER_TAGS, "kind"))
        self.adapter_labels: set[str] = set()
        # Tenants (docs/tenancy.md): by key name, at most MAX_KEY_LABELS per process.
        self.key_requests = counter("llm_gateway_key_requests", "Generations by API key.",
                                    KEY_TAGS)
        self.key_tokens = counter("llm_gateway_key_tokens", "Tokens by API key (kind: prompt "
                                  "or generated).", (*KEY_TAGS, "kind"))
        self.key_labels: set[str] = set()
        # How generations sent to an engine deployment streamed back: a "ray" count where the
        # channel is configured means it fell back (the engine replica could not reach it).
        self.engine_streams = counter("llm_gateway_engine_streams", "Generations sent to a "
                                      "model's engine deployment, by how their events came "
                                      "back: channel (the engine channel) or ray (Serve's "
                                      "streamed results).", ("model", "transport"))
        self.ttft = histogram("llm_gateway_time_to_first_token_seconds",
                              "Streamed generations: arrival to first token (seconds).",
                              LATENCY_BUCKETS_S)
        # Observed once per token: counted here, not by Ray (CountedHistogram says why).
        self.itl = CountedHistogram(
            make, "llm_gateway_inter_token_latency_seconds",
            "Streamed generations: between consecutive tokens (seconds).",
            TOKEN_GAP_BUCKETS_S, GENERATION_TAGS, levels)
        self.latency = histogram("llm_gateway_request_latency_seconds",
                                 "Generations: arrival to end (seconds).", LATENCY_BUCKETS_S)
        self.in_flight = make.Gauge("llm_gateway_requests_in_flight",
                                    description="Generations started here and not yet ended "
                                    "(queued ones included).", tag_keys=GENERATION_TAGS)
        self.websockets = make.Gauge("llm_gateway_websockets_open",
                                     description="Websocket connections open (LMTP).",
                                     tag_keys=("protocol",))


def bounded_label(labels: set[str], value: str, most: int) -> str:
    """``value`` while at most ``most`` distinct ones are named, else ``other``."""
    if value not in labels and len(labels) < most:
        labels.add(value)
    return value if value in labels else "other"


@functools.cache
def gateway_metrics() -> GatewayMetrics:
    """This process's gateway series, through Ray's metrics system."""
    return GatewayMetrics(ray_metrics())


class RequestRecord:
    """One HTTP request or websocket, as the telemetry sees it."""

    __slots__ = ("error_kind", "owners", "refusal", "request_id", "scope", "streamed")

    def __init__(self, scope: dict, request_id: str, owners: dict[Callable, str]):
        self.scope = scope
        self.request_id = request_id
        self.owners = owners
        self.streamed = scope["type"] == "websocket"
        self.refusal: str | None = None  # named by whoever refused it
        self.error_kind: str | None = None  # an engine's refusal (ErrorEvent.kind)

    @property
    def protocol(self) -> str:
        # The router has put the matched endpoint in the scope by the time anything asks.
        return self.owners.get(self.scope.get("endpoint"), "gateway")

    def reason(self, status: int) -> str:
        return self.refusal or self.error_kind or _REASONS.get(
            status, "error" if status >= 500 else "client_error")


_CURRENT: ContextVar[RequestRecord | None] = ContextVar("llm_gateway_request", default=None)


def current_record() -> RequestRecord | None:
    return _CURRENT.get()


def refused_for(reason: str) -> None:
    """Name why the current request is being refused (its refusal is counted by this)."""
    record = _CURRENT.get()
    if record is not None:
        record.refusal = reason


def _request_id(scope: dict) -> str:
    for name, value in scope.get("headers") or ():
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if _CLIENT_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


class RequestTelemetry:
    """ASGI middleware: the :class:`RequestRecord` of each request, ``x-request-id`` on its
    response, refusals counted by reason, websockets open. ``owners``: endpoint → protocol.
    ``answer_ids``: whether to add ``x-request-id`` to responses (not in a Serve replica:
    Serve's own middleware around the app adds it, with the same id)."""

    def __init__(self, app, *, metrics: GatewayMetrics, owners: dict[Callable, str],
                 answer_ids: bool = True):
        self.app = app
        self.metrics = metrics
        self.owners = owners
        self.answer_ids = answer_ids

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        record = RequestRecord(scope, _request_id(scope), self.owners)
        token = _CURRENT.set(record)
        try:
            if scope["type"] == "websocket":
                await self._websocket(record, receive, send)
            else:
                await self._http(record, receive, send)
        finally:
            _CURRENT.reset(token)

    async def _http(self, record: RequestRecord, receive, send) -> None:
        """The request, and this replica's own HTTP series for it (``metrics.py``)."""
        status = [500]  # what a request that fails before its response start counts as
        started = time.perf_counter()
        http_series.IN_FLIGHT.inc()
        try:
            await self.app(record.scope, receive, self._http_sender(record, send, status))
        finally:
            http_series.IN_FLIGHT.dec()
            http_series.record_response(record.scope, status[0], time.perf_counter() - started)

    def _http_sender(self, record: RequestRecord, send, sent: list[int]):
        async def sender(message):
            if message["type"] == "http.response.start":
                sent[0] = message["status"]
                headers = message["headers"] = list(message.get("headers") or ())
                if self.answer_ids and all(n.lower() != b"x-request-id" for n, _ in headers):
                    headers.append((b"x-request-id", record.request_id.encode("latin-1")))
                content_type = next((v for n, v in headers if n.lower() == b"content-type"), b"")
                record.streamed = content_type.startswith(STREAM_TYPES)
                status = message["status"]
                if status >= 400:
                    self.metrics.refusals.inc(1, tags={
                        "protocol": record.protocol, "reason": record.reason(status),
                        "status": str(status)})
            await send(message)

        return sender

    async def _websocket(self, record: RequestRecord, receive, send) -> None:
        tags: dict[str, str] = {}

        async def sender(message):
            if message["type"] == "websocket.accept" and not tags:
                tags["protocol"] = record.protocol  # routed by now
                self.metrics.levels.add(self.metrics.websockets, tags, +1)
            await send(message)

        try:
            await self.app(record.scope, receive, sender)
        finally:
            if tags:
                self.metrics.levels.add(self.metrics.websockets, tags, -1)


class _Generation:
    """What one generation did, seen event by event."""

    __slots__ = ("choices", "finals", "first_s", "forced", "gaps", "last_s", "outcome",
                 "prompt_tokens", "record", "started_s", "tokens", "usage_forced",
                 "usage_tokens")

    def __init__(self, choices: int, record: RequestRecord | None):
        self.choices = choices
        self.record = record
        self.started_s = self.last_s = time.perf_counter()
        self.first_s: float | None = None
        self.gaps: list[float] = []
        self.tokens = self.forced = self.finals = 0
        self.usage_tokens: int | None = None  # completion tokens the engine reported
        self.usage_forced = 0
        self.prompt_tokens = 0
        self.outcome: str | None = None

    def see(self, event: Event) -> None:
        if type(event) is TokenEvent:
            now = time.perf_counter()
            if self.first_s is None:
                self.first_s = now
            else:
                self.gaps.append(now - self.last_s)
            self.last_s = now
            self.tokens += 1
            self.forced += event.forced
        elif type(event) is FinalEvent:
            self._final(event)
        elif type(event) is ErrorEvent:
            self.outcome = event.kind
            if self.record is not None:
                # Named now: the protocol answers with its error status before this stream
                # ends, and the refusal is counted under this reason at that moment.
                self.record.error_kind = event.kind

    def _final(self, event: FinalEvent) -> None:
        usage = event.usage
        self.prompt_tokens = usage.prompt_tokens  # the same on every choice
        self.usage_tokens = (self.usage_tokens or 0) + usage.completion_tokens
        self.usage_forced += usage.forced_tokens
        self.finals += 1
        if self.outcome not in (None, "timeout"):
            return
        timed_out = event.finish_reason == "abort" and event.stop_reason == "timeout"
        self.outcome = "timeout" if timed_out else self.outcome or event.finish_reason
        if self.finals < self.choices and self.outcome != "timeout":
            self.outcome = None  # decided by the last choice

    def result(self) -> str:
        return self.outcome or "aborted"


class InstrumentedEngine(EngineWrapper):
    """An engine client whose generations are measured for the current request's protocol."""

    def __init__(self, inner: EngineClient, *, model: str, engine: str, metrics: GatewayMetrics):
        super().__init__(inner)
        self.model = model
        self.engine = engine
        self.metrics = metrics

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        record = _CURRENT.get()
        tags = {"model": self.model, "protocol": record.protocol if record else "gateway",
                "engine": self.engine}
        seen = _Generation(request.sampling.n, record)
        self.metrics.levels.add(self.metrics.in_flight, tags, +1)
        try:
            # aclosing: closing this stream (the client left) closes the engine's now, which
            # aborts its request.
            async with aclosing(self.inner.generate(request)) as events:
                async for event in events:
                    seen.see(event)
                    yield event
        finally:
            self.metrics.levels.add(self.metrics.in_flight, tags, -1)
            self._record(request, seen, record, tags)

    def _record_adapter(self, adapter: str, outcome: str, prompt: int, generated: int) -> None:
        tags = {"model": self.model, "adapter": bounded_label(
            self.metrics.adapter_labels, adapter, MAX_ADAPTER_LABELS)}
        self.metrics.adapter_requests.inc(1, tags={**tags, "outcome": outcome})
        for kind, count in (("prompt", prompt), ("generated", generated)):
            if count:
                self.metrics.adapter_tokens.inc(count, tags={**tags, "kind": kind})

    def _record(self, request: GenerateRequest, seen: _Generation, record: RequestRecord | None,
                tags: dict[str, str]) -> None:
        metrics = self.metrics
        metrics.requests.inc(1, tags={**tags, "outcome": seen.result()})
        metrics.latency.observe(time.perf_counter() - seen.started_s, tags=tags)
        if seen.prompt_tokens:
            metrics.prompt_tokens.inc(seen.prompt_tokens, tags=tags)
        # The engine's own count when it reported one (splices make it differ from the events).
        reported = seen.usage_tokens is not None
        generated = seen.usage_tokens if reported else seen.tokens
        forced = seen.usage_forced if reported else seen.forced
        if generated:
            metrics.generation_tokens.inc(generated, tags=tags)
        if forced:
            metrics.forced_tokens.inc(forced, tags=tags)
        if request.adapter is not None:
            self._record_adapter(request.adapter.name, seen.result(), seen.prompt_tokens,
                                 generated)
        if seen.first_s is not None and record is not None and record.streamed:
            metrics.ttft.observe(seen.first_s - seen.started_s, tags=tags)
            if seen.gaps:
                metrics.itl.observe_all(seen.gaps, tags)

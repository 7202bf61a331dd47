"""What Serve's HTTP proxy answers itself, in the protocol's shape, and what it refuses before
any Ray call.

Some answers never come from the gateway app: when the ingress replica dies before the
response starts, the proxy sends nothing and uvicorn answers a plain-text ``500 Internal Server
Error``; a proxy timeout is a plain-text 408; back-pressure or no ingress replica a plain-text
503. No protocol client parses those. These middlewares run in the proxy process, installed
with

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=gateway.edge.proxy:middlewares

in the environment Ray starts with (``scripts/serve.sh``, the test session, ``cluster.yaml``).

:class:`ProxyGate` refuses, at once and without reading the body: requests for an application
whose ingress has no replica (Serve would hold them until a replacement started;
``gateway.edge.ingress_watch``), and requests beyond ``LLM_GATEWAY_PROXY_MAX_REQUESTS`` in flight
through this proxy (a burst's excess costs the proxy no Ray call; docs/reliability.md).

A response that has started is left alone: if the ingress dies mid-stream the chunked body
ends without its terminator, which every HTTP client reports as an error; closing it cleanly
here would turn that into a silent truncation.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from starlette.middleware import Middleware

from gateway.edge.ingress_watch import IngressWatch
from gateway.ingress.limits import CAPACITY_HEADER
from gateway.shapes import DIED, RESTARTING, TIMED_OUT, ErrorShapes

__all__ = ["FULL", "MAX_REQUESTS_VAR", "ProxyErrorShape", "ProxyGate", "max_requests_from_env",
           "middlewares", "positive_int_from_env"]

log = logging.getLogger("llm_gateway.proxy")

MAX_REQUESTS_VAR = "LLM_GATEWAY_PROXY_MAX_REQUESTS"
# The ingress's own default limit (GatewayConfig.max_concurrent_requests), per proxy.
DEFAULT_MAX_REQUESTS = 512
# Probes answer from what the ingress already knows: never refused for load.
_PROBES = frozenset({"/health", "/version", "/ping", "/v2/health/live", "/v2/health/ready"})

# Fixed texts: the proxy's own messages carry request ids and deployment names.
_MESSAGES = {
    408: TIMED_OUT,
    429: "The gateway is overloaded; retry later.",
    503: "The gateway is unavailable or overloaded; retry later.",
}
FULL = "The gateway is at capacity; retry later."
_SLACK = 8
_STARTS = frozenset({"http.response.start", "websocket.accept", "websocket.close"})


_CLIENT_GONE = 499  # Serve's status for a client that left: nobody reads an answer


def _plain_error(message: dict) -> bool:
    if message["status"] < 400 or message["status"] == _CLIENT_GONE:
        return False
    headers = {k.lower(): v for k, v in message.get("headers") or []}
    if b"x-gateway-shaped" in headers:  # a protocol's own plain-text error (AICI's APIError)
        return False
    return headers.get(b"content-type", b"text/plain").startswith(b"text/plain")


async def _answer(shapes: ErrorShapes, scope, status: int, message: str | None, receive,
                  send) -> None:
    response = shapes.response(scope["path"], status,
                               message or "The gateway could not answer this request.")
    if status in (429, 503):
        response.headers["retry-after"] = "1"
    await response(scope, receive, send)


def _is_probe(path: str, prefix: str) -> bool:
    """A probe path of the application routed at ``prefix`` (``/pipeline/health``)."""
    return path[len(prefix.rstrip("/")):] in _PROBES


def positive_int_from_env(name: str, default: int) -> int:
    """The environment variable ``name`` when a positive integer, else ``default``: a bad value
    must not keep Serve's proxy or HAProxy from starting (it is logged)."""
    raw = os.environ.get(name) or ""
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    if raw:
        log.warning("%s=%r is not a positive integer: using %d", name, raw, default)
    return default


def max_requests_from_env() -> int:
    return positive_int_from_env(MAX_REQUESTS_VAR, DEFAULT_MAX_REQUESTS)


def _proxy_own(scope) -> bool:
    # The proxy's own endpoints (/-/healthz, /-/routes) answer load balancers as they are.
    return scope["type"] not in ("http", "websocket") or scope["path"].startswith("/-/")


def _one_request_id(start: dict) -> None:
    """Serve writes ``x-request-id`` twice behind its proxy (its proxy's middleware and the
    replica's, the same id): a client reads one. The ingress's capacity header is for Serve's
    proxy alone: never a client's (a replica's own server has no gate to take it off)."""
    seen = False
    headers = []
    for name, value in start.get("headers") or ():
        lowered = name.lower()
        if lowered == CAPACITY_HEADER:
            continue
        if lowered == b"x-request-id":
            if seen:
                continue
            seen = True
        headers.append((name, value))
    start["headers"] = headers


class ProxyErrorShape:
    """Pure ASGI middleware for the proxy: plain-text errors become the protocol's error, and
    a request that ends with no response at all becomes a 503 with ``Retry-After``."""

    def __init__(self, app, shapes: ErrorShapes | None = None):
        self.app = app
        self.shapes = shapes or ErrorShapes.of_every_protocol()

    async def __call__(self, scope, receive, send):
        if _proxy_own(scope) or scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False
        held: dict | None = None  # a plain-text error start, replaced once its body has ended

        async def shaped_send(message):
            nonlocal started, held
            if message["type"] == "http.response.start":
                if _plain_error(message):
                    held = message
                    return
                started = True
                _one_request_id(message)
            elif held is not None and message["type"] == "http.response.body":
                if not message.get("more_body"):
                    status = held["status"]
                    held = None
                    await _answer(self.shapes, scope, status, _MESSAGES.get(status), receive,
                                  send)
                    started = True
                return
            await send(message)

        try:
            await self.app(scope, receive, shaped_send)
        except Exception:
            if started:
                raise
            log.exception("proxy failed on %s before answering", scope["path"])
            await _answer(self.shapes, scope, 503, DIED, receive, send)
            return
        if not started:
            # The proxy gave up without a response (the ingress replica died).
            await _answer(self.shapes, scope, 503, DIED, receive, send)


class _Answer:
    __slots__ = ("at", "body", "start")

    def __init__(self, start: dict, body: bytes):
        self.start, self.body, self.at = start, body, time.monotonic()


class ProbeCache:
    """Probes (``/health`` ...) answered from the ingress's last answer to the same path, which
    is fetched again in the background when it is older than ``refresh_s``: under a burst the
    ingress answers late (10 s measured), a load balancer's probe should not wait for it. An
    answer older than ``stale_s`` (a load balancer's 10 s interval fits) is not used; an
    ingress that is gone is the gate's to answer (:class:`IngressWatch`). Keys are the probe
    paths of known applications only, so the cache stays as small as they are."""

    def __init__(self, refresh_s: float = 0.5, stale_s: float = 15.0, timeout_s: float = 30.0):
        self.refresh_s, self.stale_s, self.timeout_s = refresh_s, stale_s, timeout_s
        self._answers: dict[str, _Answer] = {}
        self._fetching: dict[str, asyncio.Task] = {}

    async def serve(self, app, scope, receive, send) -> None:
        path = scope["path"]
        cached = self._answers.get(path)
        age = None if cached is None else time.monotonic() - cached.at
        if cached is None or age > self.stale_s:
            return await self._fetch(app, scope, receive, send)
        if age > self.refresh_s and path not in self._fetching:
            task = asyncio.ensure_future(self._fetch(app, dict(scope), _empty_body(), None))
            self._fetching[path] = task
            task.add_done_callback(lambda _: self._fetching.pop(path, None))
        await send(cached.start)
        await send({"type": "http.response.body", "body": cached.body})

    async def _fetch(self, app, scope, receive, send) -> None:
        """One request through the app; its answer is kept, and also sent when ``send``."""
        start, chunks = None, []

        async def capture(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body") and start is not None:
                    self._answers[scope["path"]] = _Answer(start, b"".join(chunks))
            if send is not None:
                await send(message)

        try:
            async with asyncio.timeout(self.timeout_s):
                await app(scope, receive, capture)
        except Exception as exc:
            if send is not None:
                raise
            log.debug("background probe of %s failed: %r", scope["path"], exc)


def _empty_body():
    """``receive`` of a request without a body whose client never leaves (a background probe)."""
    pending = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        await asyncio.get_running_loop().create_future()  # never resolved

    return receive


class ProxyGate:
    """Pure ASGI middleware for the proxy: refusals before any Ray call (module docstring).
    Websockets are refused by closing with 1013 ("try again later")."""

    def __init__(self, app, shapes: ErrorShapes | None = None, watch: IngressWatch | None = None,
                 max_requests: int | None = None):
        self.app = app
        self.shapes = shapes or ErrorShapes.of_every_protocol()
        self.watch = watch or IngressWatch()
        self.max_requests = max_requests or max_requests_from_env()
        self.inflight = 0
        self.probes = ProbeCache()
        self.posts: dict[str, int] = {}  # POSTs in flight per application
        self.capacity: dict[str, int] = {}  # per application, as its ingress last said

    async def __call__(self, scope, receive, send):
        if _proxy_own(scope):
            return await self.app(scope, receive, send)
        path = scope["path"]
        prefix, app = self.watch.route(path) or ("", None)
        if app is not None and app in self.watch.reading.down:
            return await self._refuse(scope, RESTARTING, receive, send)
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD") and _is_probe(
                path, prefix):
            return await self.probes.serve(self._stripping(app), scope, receive, send)
        generation = app is not None and scope["type"] == "http" and scope["method"] == "POST"
        if self.inflight >= self.max_requests or (
                generation and self.posts.get(app, 0) >= self._generation_bound(app)):
            return await self._refuse(scope, FULL, receive, send)
        self.inflight += 1
        if generation:
            self.posts[app] = self.posts.get(app, 0) + 1
        try:
            await self._unless_ingress_dies(scope, receive, send, app)
        finally:
            self.inflight -= 1
            if generation:
                self.posts[app] -= 1

    def _generation_bound(self, app: str) -> float:
        """POSTs the application's ingress replicas could still admit: what each sends its
        models at most (its ``x-gateway-capacity``) times the replicas running, plus a few
        that its own refusal answers with the model's name; unbounded until it said."""
        capacity = self.capacity.get(app)
        if capacity is None:
            return float("inf")
        return capacity * max(self.watch.reading.replicas.get(app, 1), 1) + _SLACK

    async def _unless_ingress_dies(self, scope, receive, send, app: str | None) -> None:
        """The request as Serve handles it; but if its application loses its last ingress
        replica before the response starts, the request was (or will be) held in Serve's
        router for a replacement: refuse it then. Takes the ingress's capacity header off."""
        started = asyncio.get_running_loop().create_future()

        async def send_once_started(message):
            if not started.done() and message["type"] in _STARTS:
                started.set_result(None)
            await send(message)

        call = asyncio.ensure_future(self._stripping(app)(scope, receive, send_once_started))
        try:
            while not call.done() and not started.done():
                down = self.watch.went_down()
                await asyncio.wait((call, started, down), return_when=asyncio.FIRST_COMPLETED)
                if down.done() and not started.done() and self.watch.is_down(scope["path"]):
                    call.cancel()
                    await asyncio.gather(call, return_exceptions=True)
                    return await self._refuse(scope, RESTARTING, receive, send)
            await call
        finally:
            if not call.done():  # this request was cancelled (its client left)
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)

    def _stripping(self, app: str | None):
        """The app, with the ingress's capacity header learned and taken off its answers."""
        async def stripped(scope, receive, send):
            async def without_capacity(message):
                if message["type"] == "http.response.start":
                    message = self._take_capacity(message, app)
                await send(message)

            await self.app(scope, receive, without_capacity)

        return stripped

    def _take_capacity(self, message: dict, app: str | None) -> dict:
        headers, kept, value = message.get("headers") or [], [], None
        for key, header_value in headers:
            if key.lower() == CAPACITY_HEADER:
                value = header_value
            else:
                kept.append((key, header_value))
        if app is not None:  # an answer without it: the ingress no longer bounds its models
            if value is not None and value.isdigit():
                self.capacity[app] = int(value)
            else:
                self.capacity.pop(app, None)
        return message if value is None else {**message, "headers": kept}

    async def _refuse(self, scope, message: str, receive, send) -> None:
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1013})
        await _answer(self.shapes, scope, 503, message, receive, send)


def middlewares() -> list[Middleware]:
    """What Serve's proxy calls at start (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``), and
    every replica's own HTTP server too (Serve's direct ingress, behind HAProxy). Serve wraps
    its app in them in list order, so the last is outermost: the error shaping sees whatever the
    gate and Serve answer. A replica's own server gets the error shaping only: the gate's
    questions are moot there (a request that reached a replica has its application's ingress,
    and HAProxy bounds what is in flight, gateway.edge.haproxy_errors), while its watch asked Serve's
    controller and the GCS twice a second under load and it wrapped every streamed chunk
    (docs/results/benchmarks-2026-12-07.md, "The gate in the replicas")."""
    shapes = ErrorShapes.of_every_protocol()
    if _in_replica():
        return [Middleware(ProxyErrorShape, shapes=shapes)]
    return [Middleware(ProxyGate, shapes=shapes), Middleware(ProxyErrorShape, shapes=shapes)]


def _in_replica() -> bool:
    """Called in a Serve replica (its direct-ingress HTTP server), not in Serve's proxy."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        serve.get_replica_context()
    except RayServeException:
        return False
    return True

"""Request body size limit (DJL's ``max_request_size``, TGI's ``--payload-limit``).

The middleware does not answer itself: when a body turns out too large it raises
``HTTPException(413)`` from ``receive``, i.e. inside the route that reads the body, so the app's
route-error handler writes the 413 in the shape of the protocol the path belongs to.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException

from gateway.ingress.telemetry import refused_for

__all__ = ["CAPACITY_HEADER", "REPLICA_HEADER", "Admission", "BodySizeLimit", "CapacityHeader",
           "ResponseHeader", "route_path"]

# The generations one ingress replica sends its models at most, on each of its answers: Serve's
# proxy refuses the excess of a burst before any Ray call (gateway.edge.proxy.ProxyGate), and takes
# the header off before the client sees it.
CAPACITY_HEADER = b"x-gateway-capacity"
# On every answer of a model's own replica (HAProxy sends a request naming the model there):
# which one served it, as Serve names its replicas; what prefix routing and its tests read.
REPLICA_HEADER = b"x-llm-gateway-replica"

# A refused body is still read, and dropped, before its 413 is sent, within these bounds. A
# client still uploading when the answer goes out has unread bytes in the server's socket; when
# the connection is then closed (by HAProxy or the server), the kernel resets it and discards
# the answer not yet delivered: the client sees a dropped connection instead of the 413 (seen
# under load behind HAProxy). Past the bounds the 413 is sent at once, as nginx's lingering
# close gives up after its own limits.
DRAIN_BYTES = 64 * 1024 * 1024
DRAIN_S = 10.0


def route_path(scope) -> str:
    """The path the app routes on: under a Serve route prefix (``/pipeline``), Starlette's
    ``scope["path"]`` still carries the prefix, which ``root_path`` names."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


class BodySizeLimit:
    """Pure ASGI middleware: bodies over ``max_bytes`` end in 413, before they are buffered.

    A declared ``Content-Length`` over the limit fails on the first read, without keeping any of
    the body; a chunked body fails as soon as the bytes received pass the limit. Either way the
    rest of the body is read and dropped, within bounds, before the 413 goes out (why:
    :data:`DRAIN_BYTES`).
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        too_large = declared.isdigit() and int(declared) > self.max_bytes
        received = 0

        async def limited_receive():
            nonlocal received
            if too_large:
                await _drain(receive, int(declared))
                raise self._error()
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if message.get("more_body", False):
                        await _drain(receive, 0)
                    raise self._error()
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> HTTPException:
        return HTTPException(413, f"Request body exceeds the limit of {self.max_bytes} bytes.")


async def _drain(receive, declared: int) -> None:
    """Reads the rest of a refused body and drops it (why and bounds: :data:`DRAIN_BYTES`)."""
    if declared > DRAIN_BYTES:
        return
    read = 0
    try:
        async with asyncio.timeout(DRAIN_S):
            while read <= DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                read += len(message.get("body", b""))
    except TimeoutError:
        return


class Admission:
    """Pure ASGI middleware: at most ``max_inflight`` HTTP requests and websocket connections
    at once (probes exempt); the excess gets a 503 in the protocol's shape at once, or a
    websocket close with 1013 ("try again later").

    It also adds ``Retry-After`` to every 429/503 (and Anthropic's 529) that lacks one, whoever
    produced it (this limit, a full engine queue, a model without a healthy replica).
    """

    def __init__(self, app, max_inflight: int, refuse, exempt: frozenset[str],
                 retry_after_s: int = 1):
        self.app = app
        self.max_inflight = max_inflight
        self.refuse = refuse  # (path, status, message) -> ASGI response
        self.exempt = exempt
        self.retry_after = str(retry_after_s).encode()
        self.inflight = 0

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = route_path(scope)
        if path in self.exempt:
            return await self.app(scope, receive, send)
        if self.inflight >= self.max_inflight:
            if kind == "websocket":
                return await send({"type": "websocket.close", "code": 1013})
            message = f"the gateway is at capacity ({self.max_inflight} requests); retry later"
            refused_for("admission")
            response = self.refuse(path, 503, message)
            return await response(scope, receive, self._with_retry_after(send))
        self.inflight += 1
        try:
            await self.app(scope, receive, self._with_retry_after(send))
        finally:
            self.inflight -= 1

    def _with_retry_after(self, send):
        async def wrapped(message):
            if message["type"] == "http.response.start" and message["status"] in (429, 503, 529):
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"retry-after" for k, _ in headers):
                    headers.append((b"retry-after", self.retry_after))
                    message = {**message, "headers": headers}
            await send(message)

        return wrapped


class ResponseHeader:
    """Pure ASGI middleware: one header on every HTTP answer."""

    def __init__(self, app, name: bytes, value: str):
        self.app = app
        self.header = (name, value.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, with_header)


class CapacityHeader(ResponseHeader):
    """:data:`CAPACITY_HEADER` on every HTTP answer: the generations this replica admits."""

    def __init__(self, app, capacity: int):
        super().__init__(app, CAPACITY_HEADER, str(capacity))

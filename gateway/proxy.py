"""Errors that Ray Serve's HTTP proxy writes itself, rewritten into the protocol's shape.

Some answers never come from the gateway app: when the ingress replica dies before the
response starts, the proxy sends nothing and uvicorn answers a plain-text ``500 Internal Server
Error``; a proxy timeout is a plain-text 408; back-pressure or no ingress replica a plain-text
503. No protocol client parses those. This middleware runs in the proxy process, installed with

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=gateway.proxy:middlewares

in the environment Ray starts with (``scripts/serve.sh``, the test session, ``cluster.yaml``).

A response that has started is left alone: if the ingress dies mid-stream the chunked body
ends without its terminator, which every HTTP client reports as an error; closing it cleanly
here would turn that into a silent truncation.
"""

from __future__ import annotations

import logging

from starlette.middleware import Middleware

from gateway.shapes import ErrorShapes
from protocols.catalog import PROTOCOLS, load_spec

__all__ = ["ProxyErrorShape", "middlewares"]

log = logging.getLogger("llm_gateway.proxy")

# Fixed texts: the proxy's own messages carry request ids and deployment names.
_MESSAGES = {
    408: "The request timed out in the gateway.",
    429: "The gateway is overloaded; retry later.",
    503: "The gateway is unavailable or overloaded; retry later.",
}
_DIED = "The gateway replica serving this request stopped; retry."


def _plain_error(message: dict) -> bool:
    if message["status"] < 400:
        return False
    headers = {k.lower(): v for k, v in message.get("headers") or []}
    if b"x-gateway-shaped" in headers:  # a protocol's own plain-text error (AICI's APIError)
        return False
    return headers.get(b"content-type", b"text/plain").startswith(b"text/plain")


class ProxyErrorShape:
    """Pure ASGI middleware for the proxy: plain-text errors become the protocol's error, and
    a request that ends with no response at all becomes a 503 with ``Retry-After``."""

    def __init__(self, app, shapes: ErrorShapes | None = None):
        self.app = app
        self.shapes = shapes or ErrorShapes([load_spec(name) for name in PROTOCOLS])

    async def __call__(self, scope, receive, send):
        # The proxy's own endpoints (/-/healthz, /-/routes) answer load balancers as they are.
        if scope["type"] != "http" or scope["path"].startswith("/-/"):
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
            elif held is not None and message["type"] == "http.response.body":
                if not message.get("more_body"):
                    status = held["status"]
                    held = None
                    await self._answer(scope, status, _MESSAGES.get(status), receive, send)
                    started = True
                return
            await send(message)

        try:
            await self.app(scope, receive, shaped_send)
        except Exception:
            if started:
                raise
            log.exception("proxy failed on %s before answering", scope["path"])
            await self._answer(scope, 503, _DIED, receive, send)
            return
        if not started:
            # The proxy gave up without a response (the ingress replica died).
            await self._answer(scope, 503, _DIED, receive, send)

    async def _answer(self, scope, status: int, message: str | None, receive, send) -> None:
        response = self.shapes.response(scope["path"], status,
                                        message or "The gateway could not answer this request.")
        if status in (429, 503):
            response.headers["retry-after"] = "1"
        await response(scope, receive, send)


def middlewares() -> list[Middleware]:
    """What Serve's proxy calls at start (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
    return [Middleware(ProxyErrorShape)]

"""Gateway-level Prometheus metrics (engine metrics stay with the engines)."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

__all__ = ["MetricsMiddleware", "render_metrics"]

REQUESTS = Counter("gateway_http_requests_total", "HTTP requests by route and status",
                   ["path", "status"])
IN_FLIGHT = Gauge("gateway_http_requests_in_flight", "HTTP requests being served")
LATENCY = Histogram("gateway_http_request_seconds", "Time to the end of the response body",
                    ["path"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))


class MetricsMiddleware:
    """Pure ASGI middleware (no body buffering, so streams stay streams)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def record(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        started = time.perf_counter()
        IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, record)
        finally:
            IN_FLIGHT.dec()
            # The router records the matched route in the scope: label by its template.
            path = getattr(scope.get("route"), "path", None) or scope["path"]
            # Unrouted paths would explode label cardinality; bucket them together.
            label = path if status["code"] != 404 else "unmatched"
            REQUESTS.labels(label, str(status["code"])).inc()
            LATENCY.labels(label).observe(time.perf_counter() - started)


def render_metrics() -> tuple[bytes, str]:
    return generate_latest(), CONTENT_TYPE_LATEST

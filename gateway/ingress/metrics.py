"""This replica's own HTTP series, for its ``GET /metrics`` (prometheus_client's registry in
this process). The cluster's series go through Ray's metrics system (``telemetry.py``, which
records these too, from the same middleware; docs/observability.md says which to scrape)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

__all__ = ["IN_FLIGHT", "record_response", "render_metrics"]

REQUESTS = Counter("gateway_http_requests_total", "HTTP requests by route and status",
                   ["path", "status"])
IN_FLIGHT = Gauge("gateway_http_requests_in_flight", "HTTP requests being served")
LATENCY = Histogram("gateway_http_request_seconds", "Time to the end of the response body",
                    ["path"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))


def record_response(scope: dict, status: int, seconds: float) -> None:
    """One HTTP request's response, labelled by its route's template (the router records the
    matched route in the scope); unrouted paths together, so labels stay bounded."""
    path = getattr(scope.get("route"), "path", None) or scope["path"]
    label = path if status != 404 else "unmatched"
    REQUESTS.labels(label, str(status)).inc()
    LATENCY.labels(label).observe(seconds)


def render_metrics() -> tuple[bytes, str]:
    return generate_latest(), CONTENT_TYPE_LATEST

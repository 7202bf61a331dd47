"""MindIE's error body ``{"error": "<message>", "error_type": "<type>"}``."""

from __future__ import annotations

from starlette.responses import Response

from contract import ErrorEvent
from protocols.errors import EnvelopeError

__all__ = ["NOT_FOUND", "from_event", "invalid", "route_error"]

VALIDATION = "Input Validation Error"
NOT_FOUND = "NotFoundError"
_OF_KIND = {"validation": (422, VALIDATION), "not_found": (404, NOT_FOUND),
            "overloaded": (503, "Service Unavailable"),
            "rate_limited": (429, "Too Many Requests"),
            "unavailable": (503, "Service Unavailable"), "engine": (424, "Generation Error")}
# Route-level errors (no route, wrong method, body too large, unexpected failure): other 4xx
# read as validation, other 5xx as a failed generation.
_OF_ROUTE_STATUS = {404: NOT_FOUND, 405: "MethodNotAllowed", 429: "Too Many Requests",
                    503: "Service Unavailable"}


def invalid(message: str) -> EnvelopeError:
    return EnvelopeError(422, message, VALIDATION)


def from_event(event: ErrorEvent) -> EnvelopeError:
    status, error_type = _OF_KIND[event.kind]
    return EnvelopeError(status, event.message, error_type)


def route_error(status: int, message: str) -> Response:
    """An HTTP-level error on a ``/v2`` path, in MindIE's body."""
    default = VALIDATION if status < 500 else "Generation Error"
    return EnvelopeError(status, message, _OF_ROUTE_STATUS.get(status, default)).response()

"""TGI's error body ``{"error", "error_type"}`` (``docs/protocols/lmi-and-tgi.md``, "TGI errors")."""

from __future__ import annotations

from starlette.responses import Response

from contract import ErrorEvent
from protocols.errors import EnvelopeError

__all__ = ["from_event", "invalid", "route_error"]

_OF_KIND = {"validation": (422, "validation"), "not_found": (404, "not_found"),
            "overloaded": (429, "overloaded"), "rate_limited": (429, "overloaded"),
            "unavailable": (503, "unavailable"), "engine": (424, "generation")}


def invalid(message: str) -> EnvelopeError:
    return EnvelopeError(422, f"Input validation error: {message}", "validation")


def from_event(event: ErrorEvent) -> EnvelopeError:
    status, error_type = _OF_KIND[event.kind]
    message = f"Input validation error: {event.message}" if status == 422 else event.message
    return EnvelopeError(status, message, error_type)


# TGI's own types where the client raises by them; the others fall back to the status code
# in TGI's client (401: UnknownError, 404: NotFoundError), never to a ValidationError.
_OF_STATUS = {401: "unauthorized", 403: "unauthorized", 404: "not_found", 429: "overloaded"}


def route_error(status: int, message: str) -> Response:
    """An HTTP-level error on a TGI path (the client raises by ``error_type``)."""
    error_type = _OF_STATUS.get(status, "validation" if status < 500 else "generation")
    return EnvelopeError(status, message, error_type).response()

"""AICI's error shape: a plain-text body ``APIError: <message>``, 400 for the caller's mistakes
and 500 otherwise (``docs/protocols/aici.md``, "REST API"); this gateway adds 404, 429 and 503 where those
are what happened (pyaici.rest shows any non-200 status with its body)."""

from __future__ import annotations

from starlette.responses import PlainTextResponse, Response

from contract import ErrorEvent
from protocols.errors import ProtocolError

__all__ = ["SHAPED_HEADER", "APIError", "from_event", "route_error"]

_STATUS_OF_KIND = {"validation": 400, "not_found": 404, "overloaded": 429, "rate_limited": 429,
                   "unavailable": 503, "engine": 500}


class APIError(ProtocolError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> Response:
        return route_error(self.status, self.message)


# Marks the gateway's own plain-text errors, which Serve's proxy must pass on as they are (it
# rewrites the plain-text errors it makes itself: gateway.edge.proxy).
SHAPED_HEADER = "x-gateway-shaped"


def route_error(status: int, message: str) -> Response:
    return PlainTextResponse(f"APIError: {message}", status_code=status,
                             headers={SHAPED_HEADER: "aici"})


def from_event(event: ErrorEvent) -> APIError:
    return APIError(_STATUS_OF_KIND[event.kind], event.message)

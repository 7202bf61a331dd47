"""Anthropic's error body: ``{"type": "error", "error": {"type": ..., "message": ...}}``, with
the statuses its API answers (docs/protocols/anthropic.md)."""

from __future__ import annotations

from starlette.responses import JSONResponse

from contract import ErrorEvent
from protocols.errors import ProtocolError

__all__ = ["OVERLOADED", "AnthropicError", "error_body", "from_event", "route_error"]

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
# Anthropic's 429 is the caller's own rate limit; a service too busy for anyone is its 529
# (the SDK's OverloadedError), which it answers where other APIs say 503.
OVERLOADED = 529
_STATUS_OF_KIND = {"validation": 400, "not_found": 404, "overloaded": OVERLOADED,
                   "rate_limited": 429, "unavailable": OVERLOADED, "engine": 500}


class AnthropicError(ProtocolError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message), status_code=self.status)


def error_body(status: int, message: str) -> dict:
    error_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def route_error(status: int, message: str) -> JSONResponse:
    """An HTTP-level error (no route, wrong method, body too large, the gateway at capacity,
    ...) on a Messages path; a 503 is Anthropic's 529."""
    return AnthropicError(OVERLOADED if status == 503 else status, message).response()


def from_event(event: ErrorEvent) -> AnthropicError:
    where = f" ({event.param})" if event.param else ""
    return AnthropicError(_STATUS_OF_KIND[event.kind], event.message + where)

"""OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

from contract import ErrorEvent
from protocols.errors import ProtocolError

__all__ = ["OpenAIError", "error_body", "error_response", "from_event", "route_error"]

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
_STATUS_OF_KIND = {"validation": 400, "not_found": 404, "overloaded": 429, "rate_limited": 429,
                   "unavailable": 503, "engine": 500}


class OpenAIError(ProtocolError):
    """Raised anywhere in the OpenAI routes; rendered as the envelope with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> JSONResponse:
        return error_response(self)


def _phrase(status: int) -> str:
    """The status's reason phrase; "error" for a code HTTP does not name (Serve's 499, a
    client that went away)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    error_type = _TYPES.get(status) or _phrase(status)
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param), status_code=exc.status)


def route_error(status: int, message: str) -> JSONResponse:
    """An HTTP-level error (no route, wrong method, body too large, ...) in the envelope."""
    return JSONResponse(error_body(status, message), status_code=status)


def from_event(event: ErrorEvent) -> OpenAIError:
    return OpenAIError(_STATUS_OF_KIND[event.kind], event.message, event.param)

"""Error types shared by every protocol package.

Each protocol raises a :class:`ProtocolError` subclass that renders itself in that protocol's
shape; the gateway registers one handler for all of them. :class:`EnvelopeError` is the
``{"error", "error_type"}`` body that MindIE and TGI share (each with its own types).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

__all__ = ["EnvelopeError", "ProtocolError"]


class ProtocolError(Exception):
    """A refusal with an HTTP status that knows its protocol's body."""

    status: int

    def response(self) -> Response:
        raise NotImplementedError


class EnvelopeError(ProtocolError):
    def __init__(self, status: int, message: str, error_type: str):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return {"error": self.message, "error_type": self.error_type}

    def response(self) -> Response:
        return JSONResponse(self.body(), status_code=self.status)

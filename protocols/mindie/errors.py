"""MindIE's error body ``{"error": "<message>", "error_type": "<type>"}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from protocols.internal import ErrorEvent

__all__ = ["VALIDATION", "MindIEError", "from_event", "invalid"]

VALIDATION = "Input Validation Error"
_OF_KIND = {"validation": (422, VALIDATION), "not_found": (404, "NotFoundError"),
            "overloaded": (503, "Service Unavailable"), "engine": (424, "Generation Error")}


class MindIEError(Exception):
    def __init__(self, status: int, message: str, error_type: str):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type

    def body(self) -> dict[str, str]:
        return {"error": self.message, "error_type": self.error_type}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(message: str) -> MindIEError:
    return MindIEError(422, message, VALIDATION)


def from_event(event: ErrorEvent) -> MindIEError:
    status, error_type = _OF_KIND[event.kind]
    return MindIEError(status, event.message, error_type)

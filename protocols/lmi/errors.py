"""LMI and TGI error bodies (shared/specs/lmi-and-tgi.md §5, §6.5).

LMI has four shapes: payload validation ``{"error", "code": 424}``; front-end errors
``{"code", "type", "message"}``; a failed generation, which is the seed's body with
``finish_reason: "error"`` plus ``error`` and ``code``; dynamic-batch failures
``{"code": 424, "message": "invoke handler failure", "error"}``. TGI has one:
``{"error", "error_type"}``.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from protocols.internal import ErrorEvent

__all__ = ["LMIError", "TGIError", "dynamic_error", "frontend_error", "generation_error",
           "payload_error", "tgi_from_event", "tgi_invalid"]

# Engine refusals of a parameter are the client's fault (DJL answers 400); a replica that is
# full is 503 as the DJL front end says; anything else failed inside the handler (424).
_LMI_STATUS = {"validation": 400, "not_found": 404, "overloaded": 503, "engine": 424}
_TGI_STATUS = {"validation": (422, "validation"), "not_found": (404, "not_found"),
               "overloaded": (429, "overloaded"), "engine": (424, "generation")}


class LMIError(Exception):
    def __init__(self, status: int, body: dict[str, Any]):
        super().__init__(str(body.get("error") or body.get("message")))
        self.status = status
        self.body = body

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)


def payload_error(message: str) -> LMIError:
    return LMIError(424, {"error": message, "code": 424})


def frontend_error(status: int, error_type: str, message: str) -> LMIError:
    return LMIError(status, {"code": status, "type": error_type, "message": message})


def generation_error(event: ErrorEvent) -> LMIError:
    status = _LMI_STATUS[event.kind]
    return LMIError(status, {
        "generated_text": "",
        "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None,
                    "tokens": None},
        "error": event.message, "code": status,
    })


def dynamic_error(message: str) -> LMIError:
    return LMIError(424, {"code": 424, "message": "invoke handler failure", "error": message})


class TGIError(Exception):
    def __init__(self, status: int, message: str, error_type: str):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.message, "error_type": self.error_type},
                            status_code=self.status)


def tgi_invalid(message: str) -> TGIError:
    return TGIError(422, f"Input validation error: {message}", "validation")


def tgi_from_event(event: ErrorEvent) -> TGIError:
    status, error_type = _TGI_STATUS[event.kind]
    message = f"Input validation error: {event.message}" if status == 422 else event.message
    return TGIError(status, message, error_type)

"""LMI error bodies (``docs/protocols/lmi-and-tgi.md``, "LMI errors").

Four shapes: payload validation ``{"error", "code": 424}``; front-end errors
``{"code", "type", "message"}``; a failed generation, which is the seed's body with
``finish_reason: "error"`` plus ``error`` and ``code``; dynamic-batch failures
``{"code": 424, "message": "invoke handler failure", "error"}``.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from contract import ErrorEvent
from protocols.errors import ProtocolError

__all__ = ["LMIError", "dynamic_error", "frontend_error", "generation_error", "payload_error",
           "route_error"]

# Engine refusals of a parameter are the client's fault (DJL answers 400); a replica that is
# full is 503 as the DJL front end says, a key over its token budget 429 (as over its request
# rate); anything else failed inside the handler (424).
_LMI_STATUS = {"validation": 400, "not_found": 404, "overloaded": 503, "rate_limited": 429,
               "unavailable": 503, "engine": 424}
# Route-level errors: DJL's exception names for the statuses it has them for.
_ROUTE_ERROR_TYPES = {404: "ResourceNotFoundException", 405: "MethodNotAllowedException"}


class LMIError(ProtocolError):
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


def route_error(status: int, message: str) -> JSONResponse:
    """An HTTP-level error (no route, wrong method, body too large, ...) on an LMI path."""
    return frontend_error(status, _ROUTE_ERROR_TYPES.get(status, "ServiceException"),
                          message).response()

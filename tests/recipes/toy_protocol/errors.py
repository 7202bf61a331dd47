"""Step 2 of docs/extending.md "Add a protocol": the toy protocol's error, in its own shape."""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from contract import ErrorEvent
from protocols.errors import ProtocolError

STATUS = {"validation": 400, "not_found": 404, "overloaded": 503, "rate_limited": 429,
          "unavailable": 503, "engine": 500}


class ToyError(ProtocolError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    def response(self) -> Response:
        headers = {"retry-after": "1"} if self.status in (429, 503) else None
        return JSONResponse({"toy_error": self.message}, status_code=self.status,
                            headers=headers)

    @classmethod
    def of(cls, event: ErrorEvent) -> ToyError:
        return cls(STATUS[event.kind], event.message)


def route_error(status: int, message: str) -> Response:
    return ToyError(status, message).response()

"""Gateway-level errors (unknown route, body too large, refused at the door, proxy failures)
in the shape of the protocol that owns the request's path."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response

from protocols.catalog import PROTOCOLS, load_spec
from protocols.spec import ProtocolSpec

__all__ = ["DIED", "NOT_RECEIVED", "RESTARTING", "TIMED_OUT", "ErrorShapes"]

# The gateway's own messages, whichever part answers (Serve's proxy, HAProxy): fixed texts,
# no request ids or deployment names.
DIED = "The gateway replica serving this request stopped; retry."
RESTARTING = "The gateway is starting or restarting; retry shortly."
TIMED_OUT = "The request timed out in the gateway."
NOT_RECEIVED = "The gateway did not receive the whole request in time; send it again."


class ErrorShapes:
    """Paths no protocol owns get the first HTTP protocol's shape (FastAPI's ``{"detail"}``
    when only websocket protocols are enabled)."""

    def __init__(self, specs: list[ProtocolSpec]):
        self.owners = [s for s in specs if s.route_error is not None]

    @classmethod
    def of_every_protocol(cls) -> ErrorShapes:
        return cls([load_spec(name) for name in PROTOCOLS])

    def owner(self, path: str) -> ProtocolSpec | None:
        if not self.owners:
            return None
        # Under a Serve route prefix (/pipeline/v1/completions) the owner is found on a suffix.
        candidates = [path] + [path[i:] for i in range(1, len(path)) if path[i] == "/"]
        for candidate in candidates:
            best = max(self.owners, key=lambda spec: spec.match(candidate))
            if best.match(candidate):
                return best
        return self.owners[0]

    def response(self, path: str, status: int, message: str) -> Response:
        owner = self.owner(path)
        if owner is None:
            return JSONResponse({"detail": message}, status_code=status)
        assert owner.route_error is not None  # owners all have one
        return owner.route_error(status, message)

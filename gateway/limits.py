"""Request body size limit (DJL's ``max_request_size``, TGI's ``--payload-limit``).

The middleware does not answer itself: when a body turns out too large it raises
``HTTPException(413)`` from ``receive``, i.e. inside the route that reads the body, so the app's
route-error handler writes the 413 in the shape of the protocol the path belongs to.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

__all__ = ["BodySizeLimit"]


class BodySizeLimit:
    """Pure ASGI middleware: bodies over ``max_bytes`` end in 413, before they are buffered.

    A declared ``Content-Length`` over the limit fails on the first read, without reading any of
    the body; a chunked body fails as soon as the bytes received pass the limit.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        too_large = declared.isdigit() and int(declared) > self.max_bytes
        received = 0

        async def limited_receive():
            nonlocal received
            if too_large:
                raise self._error()
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._error()
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> HTTPException:
        return HTTPException(413, f"Request body exceeds the limit of {self.max_bytes} bytes.")

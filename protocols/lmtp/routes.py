"""LMTP over websocket at ``/`` (where LMQL's client connects) and ``/lmtp``.

Plain HTTP requests to ``/`` are not LMTP and keep working for other uses (see the gateway).
The app must carry a model registry at ``app.state.registry`` and LMTP's options
(:class:`LMTPLimits`, ``protocols.spec.options_of``).
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from protocols.lmtp.session import LMTPLimits, LMTPSession
from protocols.spec import options_of

__all__ = ["router"]

router = APIRouter()


@router.websocket("/")
@router.websocket("/lmtp")
async def lmtp(websocket: WebSocket) -> None:
    registry = websocket.app.state.registry
    await LMTPSession(websocket, registry.resolve, registry.info,
                      options_of(websocket, LMTPLimits)).run()

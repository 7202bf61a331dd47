"""LMTP over websocket at ``/`` (where LMQL's client connects) and ``/lmtp``.

Plain HTTP requests to ``/`` are not LMTP and keep working for other uses (see the gateway).
The app must carry a model registry at ``app.state.registry``.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from protocols.lmtp.session import LMTPSession

__all__ = ["router"]

router = APIRouter()


@router.websocket("/")
@router.websocket("/lmtp")
async def lmtp(websocket: WebSocket) -> None:
    registry = websocket.app.state.registry
    await LMTPSession(websocket, registry.resolve, registry.info).run()

"""LMTP over websocket at ``/`` (where LMQL's client connects) and ``/lmtp``.

Plain HTTP requests to ``/`` are not LMTP and keep working for other uses (see the gateway).
The app must carry a model registry at ``app.state.registry``.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from protocols.lmtp.session import LMTPLimits, LMTPSession

__all__ = ["router"]

router = APIRouter()


@router.websocket("/")
@router.websocket("/lmtp")
async def lmtp(websocket: WebSocket) -> None:
    registry, config = websocket.app.state.registry, websocket.app.state.config
    limits = LMTPLimits(max_streams=config.lmtp_max_streams,
                        max_frame_bytes=config.lmtp_max_frame_bytes,
                        outbox_items=config.lmtp_outbox_items,
                        idle_timeout_s=config.lmtp_idle_timeout_s)
    await LMTPSession(websocket, registry.resolve, registry.info, limits).run()

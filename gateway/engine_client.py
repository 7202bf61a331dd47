"""The engine contract over a Ray Serve deployment handle (used inside the ingress)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from ray.serve.handle import DeploymentHandle

from protocols.internal import (
    EngineStats,
    ErrorEvent,
    Event,
    GenerateRequest,
    ModelInfo,
    Prompt,
    decode_events,
)

__all__ = ["ServeEngineClient"]

log = logging.getLogger(__name__)


class ServeEngineClient:
    """:class:`protocols.internal.EngineClient` backed by an ``EngineDeployment`` handle."""

    def __init__(self, handle: DeploymentHandle):
        self._handle = handle
        self._streaming = handle.options(stream=True)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        response = self._streaming.generate.remote(request)
        finished = False
        try:
            async for blob in response:
                for event in decode_events(blob):
                    yield event
            finished = True
        except Exception as exc:  # replica died, backpressure, ...: end the stream cleanly
            log.warning("engine call for %s failed: %s", request.request_id, exc)
            kind = "overloaded" if "BackPressure" in type(exc).__name__ else "engine"
            yield ErrorEvent(kind=kind, message=f"engine unavailable: {type(exc).__name__}")
            finished = True
        finally:
            if not finished:  # client went away: cancelling the call aborts the engine request
                response.cancel()

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        return await self._handle.tokenize.remote(prompt)

    async def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return await self._handle.detokenize.remote(token_ids)

    async def model_info(self) -> ModelInfo:
        return await self._handle.model_info.remote()

    async def check_health(self) -> None:
        await self._handle.check_health.remote()

    async def stats(self) -> EngineStats:
        return await self._handle.stats.remote()

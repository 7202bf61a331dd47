"""OpenAI-compatible HTTP routes: completions, chat, models, tokenize/detokenize.

Thin: each route hands the body to ``serving`` and wraps the result.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from protocols.openai import adapters, serving
from protocols.spec import options_of

__all__ = ["OpenAIOptions", "router"]

router = APIRouter()


class OpenAIOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What OpenAI's routes read of the gateway's configuration (docs/configuration.md)."""

    # Choices one request may ask for (prompts times n / best_of), refused in shape beyond.
    max_fanout: int = 256


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return await serving.list_models(request.app.state.registry)


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str) -> dict:
    return await serving.get_model(request.app.state.registry, model)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    return PlainTextResponse(adapters.load_adapter(await request.body(),
                                                   request.app.state.registry))


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    return PlainTextResponse(adapters.unload_adapter(await request.body(),
                                                     request.app.state.registry))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    result = await serving.completions(await request.body(), request.app.state.registry,
                                       _max_fanout(request))
    return serving.as_response(result, request.headers.get("x-request-id"))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    result = await serving.chat_completions(await request.body(), request.app.state.registry,
                                            _max_fanout(request))
    return serving.as_response(result, request.headers.get("x-request-id"))


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    return await serving.tokenize(await request.body(), request.app.state.registry)


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    return await serving.detokenize(await request.body(), request.app.state.registry)


def _max_fanout(request: Request) -> int:
    return options_of(request, OpenAIOptions).max_fanout

"""OpenAI-compatible HTTP routes: completions, chat, models, tokenize/detokenize.

The app must carry a model registry at ``app.state.registry`` (see ``gateway.registry``).
Streams are peeked before the response starts, so a request the engine refuses gets a real
4xx instead of a 200 stream carrying an error.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from protocols.internal import ChatPrompt, EngineClient, GenerateRequest, TextPrompt
from protocols.openai.encode import (
    ChunkMeta,
    chat_chunks,
    chat_response,
    collect,
    completion_chunks,
    completion_response,
    sse,
    with_echo,
)
from protocols.openai.errors import OpenAIError, from_event
from protocols.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
)
from protocols.openai.translate import chat_messages, chat_request, completion_requests, decode_body
from protocols.streams import Peeked, merge, peek, reindexed

if TYPE_CHECKING:
    from gateway.registry import ModelRegistry

__all__ = ["router"]

router = APIRouter()


def _registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


def _resolve(request: Request, name: str | None) -> tuple[str, EngineClient]:
    from gateway.registry import ModelNotFound, ModelRequired

    try:
        return _registry(request).resolve(name)
    except ModelNotFound as exc:
        raise OpenAIError(404, str(exc), "model") from None
    except ModelRequired as exc:
        raise OpenAIError(400, str(exc), "model") from None


async def _model_card(registry: ModelRegistry, name: str) -> dict:
    info = await registry.info(name)
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "llm-gateway",
            "root": info.root, "parent": None, "max_model_len": info.max_model_len,
            "permission": []}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    registry = _registry(request)
    cards = await asyncio.gather(*(_model_card(registry, n) for n in registry.names()))
    return {"object": "list", "data": list(cards)}


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str) -> dict:
    name, _ = _resolve(request, model)
    return await _model_card(_registry(request), name)


def _usage_mode(options: StreamOptions | None):
    if options is None or not options.include_usage:
        return "none"
    return "continuous" if options.continuous_usage_stats else "final"


async def _start(engine: EngineClient, requests: list[GenerateRequest], echo: bool) -> AsyncIterator:
    """Start every sub-request, peek each, and merge them into one event stream."""
    peeked: list[Peeked] = list(await asyncio.gather(*(peek(engine.generate(r)) for r in requests)))
    for p in peeked:
        if p.error is not None:
            await asyncio.gather(*(q.aclose() for q in peeked), return_exceptions=True)
            raise from_event(p.error)
    n = requests[0].sampling.n
    streams = [reindexed(with_echo(aiter(p)) if echo else aiter(p), i * n)
               for i, p in enumerate(peeked)]
    return merge(streams)


def _headers(request: Request) -> dict[str, str]:
    rid = request.headers.get("x-request-id")
    return {"x-request-id": rid} if rid else {}


@router.post("/v1/completions")
async def completions(request: Request):
    body = decode_body(await request.body(), CompletionRequest)
    name, engine = _resolve(request, body.model)
    meta = ChunkMeta(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=name, n=body.n)
    requests = completion_requests(body, name, meta.id)
    events = await _start(engine, requests, body.echo)
    logprobs = body.logprobs is not None
    if body.stream:
        chunks = completion_chunks(events, meta, logprobs=logprobs,
                                   usage=_usage_mode(body.stream_options))
        return StreamingResponse(sse(chunks), media_type="text/event-stream",
                                 headers=_headers(request))
    collected = await collect(events, body.n)
    return JSONResponse(completion_response(collected, meta, logprobs=logprobs),
                        headers=_headers(request))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    body = decode_body(await request.body(), ChatCompletionRequest)
    name, engine = _resolve(request, body.model)
    meta = ChunkMeta(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=name,
                     n=body.n)
    events = await _start(engine, [chat_request(body, name, meta.id)], echo=False)
    if body.stream:
        chunks = chat_chunks(events, meta, choices=body.n, logprobs=body.logprobs,
                             usage=_usage_mode(body.stream_options))
        return StreamingResponse(sse(chunks), media_type="text/event-stream",
                                 headers=_headers(request))
    collected = await collect(events, body.n)
    return JSONResponse(chat_response(collected, meta, logprobs=body.logprobs),
                        headers=_headers(request))


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    body = decode_body(await request.body(), TokenizeRequest)
    name, engine = _resolve(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "exactly one of prompt or messages is required", "prompt")
    if body.prompt is not None:
        prompt = TextPrompt(text=body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        prompt = ChatPrompt(messages=chat_messages(body.messages),
                            add_generation_prompt=body.add_generation_prompt)
    tokens = list(await engine.tokenize(prompt))
    info = await _registry(request).info(name)
    result = {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        result["token_strs"] = list(
            await asyncio.gather(*(engine.detokenize((t,)) for t in tokens))
        )
    return result


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    body = decode_body(await request.body(), DetokenizeRequest)
    name, engine = _resolve(request, body.model)
    vocab_size = (await _registry(request).info(name)).vocab_size
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise OpenAIError(400, f"token ids must be in [0, {vocab_size})", "tokens")
    return {"prompt": await engine.detokenize(tuple(body.tokens))}

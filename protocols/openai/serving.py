"""OpenAI serving logic, callable without HTTP (``routes`` and LMI's OpenAI-shaped bodies both
use it): decode and translate a body, run it on the model's engine, encode the answer.

Results are a response body (``dict``) or an SSE byte stream; refusals raise
:class:`~protocols.openai.errors.OpenAIError`. Streams are peeked before they are returned, so
a request the engine refuses raises instead of becoming a 200 stream carrying an error.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from contract import ChatPrompt, GenerateRequest, ModelNotFound, ModelRequired, TextPrompt
from contract.client import EngineClient, ModelDirectory
from protocols.openai.adapters import adapter_cards
from protocols.openai.encode import (
    ChunkMeta,
    chat_chunks,
    chat_response,
    collect,
    completion_chunks,
    completion_response,
    sse,
    with_echo,
    with_prompt_scores,
)
from protocols.openai.errors import OpenAIError, from_event
from protocols.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
)
from protocols.openai.translate import (
    chat_messages,
    chat_request,
    completion_requests,
    decode_body,
    template_kwargs,
)
from protocols.streams import Peeked, fold_splices, merge, peek, reindexed
from protocols.tools import grammar_refusal

__all__ = ["Result", "as_response", "chat_completions", "completions", "detokenize", "get_model",
           "list_models", "tokenize"]

Result = dict[str, Any] | AsyncIterator[bytes]


def as_response(result: Result, request_id: str | None = None) -> Response:
    """The HTTP response for ``result``; a client's ``x-request-id`` is echoed."""
    headers = {"x-request-id": request_id} if request_id else {}
    if isinstance(result, dict):
        return JSONResponse(result, headers=headers)
    return StreamingResponse(result, media_type="text/event-stream", headers=headers)


def _resolve(models: ModelDirectory, name: str | None) -> tuple[str, EngineClient]:
    try:
        return models.resolve(name)
    except ModelNotFound as exc:
        raise OpenAIError(404, str(exc), "model") from None
    except ModelRequired as exc:
        raise OpenAIError(400, str(exc), "model") from None


async def _model_card(models: ModelDirectory, name: str) -> dict:
    info = await models.info(name)
    parent = models.parent(name)
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "llm-gateway",
            "root": name if parent else info.root, "parent": parent,
            "max_model_len": info.max_model_len, "permission": []}


async def list_models(models: ModelDirectory) -> dict:
    cards = await asyncio.gather(*(_model_card(models, n) for n in models.names()))
    return {"object": "list", "data": [*cards, *adapter_cards(models)]}


async def get_model(models: ModelDirectory, model: str) -> dict:
    name, _ = _resolve(models, model)
    return await _model_card(models, name)


def _usage_mode(options: StreamOptions | None):
    if options is None or not options.include_usage:
        return "none"
    return "continuous" if options.continuous_usage_stats else "final"


async def _start(engine: EngineClient, requests: list[GenerateRequest], echo: bool,
                 stream: bool, scores: int | None = None) -> AsyncIterator:
    """Start every sub-request, peek each, and merge them into one event stream. With echo, a
    whole response's splices are folded before the prompt is echoed (``collect`` folds the
    rest), so a fork copies the echo once and a backtrack cannot withdraw it. ``scores``: each
    prompt's logprobs in vLLM's ``prompt_logprobs`` shape, top ``scores`` per position (whole
    responses only: a stream has no field for them)."""
    peeked: list[Peeked] = list(await asyncio.gather(*(peek(engine.generate(r)) for r in requests)))
    for p in peeked:
        if p.error is not None:
            await asyncio.gather(*(q.aclose() for q in peeked), return_exceptions=True)
            raise from_event(p.error)
    n = requests[0].sampling.n
    streams = []
    for i, p in enumerate(peeked):
        events = reindexed(fold_splices(aiter(p)) if echo and not stream else aiter(p), i * n)
        if scores is not None and not stream:
            events = with_prompt_scores(events, range(i * n, (i + 1) * n), scores)
        streams.append(with_echo(events) if echo else events)  # its choices' final indices
    return merge(streams)


DEFAULT_MAX_FANOUT = 256  # GatewayConfig.max_fanout's default


async def completions(raw: bytes | dict | CompletionRequest, models: ModelDirectory,
                      max_fanout: int = DEFAULT_MAX_FANOUT) -> Result:
    """``/v1/completions``; ``raw`` is the JSON body, as bytes or already decoded. A prompt list
    times ``n`` above ``max_fanout`` engine sequences is refused before anything starts."""
    body = raw if isinstance(raw, CompletionRequest) else decode_body(raw, CompletionRequest)
    name, engine = _resolve(models, body.model)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    requests = completion_requests(body, name, request_id)
    if len(requests) * body.n > max_fanout:
        raise OpenAIError(400, f"this request would start {len(requests)} prompts x n={body.n} "
                               f"sequences; at most {max_fanout} are allowed per request",
                          "prompt")
    meta = ChunkMeta(id=request_id, created=int(time.time()), model=name, n=body.n,
                     prompts=len(requests))
    events = await _start(engine, requests, body.echo, body.stream, body.prompt_logprobs)
    logprobs = body.logprobs is not None
    if body.stream:
        return sse(completion_chunks(events, meta, logprobs=logprobs,
                                     usage=_usage_mode(body.stream_options)))
    return completion_response(await collect(events, body.n, meta.prompts), meta,
                               logprobs=logprobs)


async def chat_completions(raw: bytes | dict | ChatCompletionRequest, models: ModelDirectory,
                           max_fanout: int = DEFAULT_MAX_FANOUT) -> Result:
    """``/v1/chat/completions``; ``raw`` is the JSON body, as bytes or already decoded."""
    body = raw if isinstance(raw, ChatCompletionRequest) else decode_body(raw,
                                                                           ChatCompletionRequest)
    name, engine = _resolve(models, body.model)
    if body.n > max_fanout:
        raise OpenAIError(400, f"n={body.n} sequences; at most {max_fanout} are allowed per "
                               f"request", "n")
    meta = ChunkMeta(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=name,
                     n=body.n)
    request, tools = chat_request(body, name, meta.id)
    if tools.mode != "none" and (refusal := await grammar_refusal(models, name)):
        raise OpenAIError(400, refusal, "tools")
    events = await _start(engine, [request], echo=False, stream=body.stream,
                          scores=body.prompt_logprobs)
    if body.stream:
        return sse(chat_chunks(events, meta, choices=body.n, logprobs=body.logprobs,
                               usage=_usage_mode(body.stream_options), tools=tools,
                               reasoning=body.include_reasoning))
    return chat_response(await collect(events, body.n), meta, logprobs=body.logprobs,
                         tools=tools, reasoning=body.include_reasoning)



async def tokenize(raw: bytes, models: ModelDirectory) -> dict:
    body = decode_body(raw, TokenizeRequest)
    name, engine = _resolve(models, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "exactly one of prompt or messages is required", "prompt")
    if body.prompt is not None:
        prompt = TextPrompt(text=body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        prompt = ChatPrompt(messages=chat_messages(body.messages),
                            add_generation_prompt=body.add_generation_prompt,
                            template_kwargs=template_kwargs(body.chat_template_kwargs))
    tokens = list(await engine.tokenize(prompt))
    info = await models.info(name)
    result = {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        # One engine call for all of them (was one per token: a fan-out of 2,000 calls).
        result["token_strs"] = list(await engine.detokenize_each(tuple(tokens)))
    return result


async def detokenize(raw: bytes, models: ModelDirectory) -> dict:
    body = decode_body(raw, DetokenizeRequest)
    name, engine = _resolve(models, body.model)
    vocab_size = (await models.info(name)).vocab_size
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise OpenAIError(400, f"token ids must be in [0, {vocab_size})", "tokens")
    return {"prompt": await engine.detokenize(tuple(body.tokens))}

"""Anthropic's Messages API: ``POST /v1/messages`` (whole or streamed) and
``POST /v1/messages/count_tokens`` (docs/protocols/anthropic.md). Streams are peeked, so a
refused request gets its status, not a 200 stream carrying an error."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from contract import GenerateRequest, ModelNotFound, ModelRequired
from contract.client import EngineClient, ModelDirectory
from protocols.anthropic.encode import MessageMeta, message_events, message_response, sse
from protocols.anthropic.errors import AnthropicError, from_event
from protocols.anthropic.schemas import CountTokensRequest, MessagesRequest
from protocols.anthropic.translate import chat_prompt, decode_body, messages_request, thinking_of
from protocols.streams import Peeked, peek
from protocols.tools import grammar_refusal

__all__ = ["router"]

router = APIRouter()


def _resolve(models: ModelDirectory, name: str | None) -> tuple[str, EngineClient]:
    try:
        return models.resolve(name)
    except ModelNotFound as exc:
        raise AnthropicError(404, f"model: {exc}") from None
    except ModelRequired as exc:
        raise AnthropicError(400, f"model: {exc}") from None


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    body = decode_body(await request.body(), MessagesRequest)
    models: ModelDirectory = request.app.state.registry
    name, engine = _resolve(models, body.model)
    meta_id = f"msg_{uuid.uuid4().hex[:24]}"
    internal, tools = messages_request(body, name, meta_id)
    thinking, _ = thinking_of(body)
    if internal.controller is not None and (refusal := await grammar_refusal(models, name)):
        raise AnthropicError(400, f"{'tools' if tools.mode != 'none' else 'output_config'}: "
                                  f"{refusal}")
    headers = {"request-id": meta_id}
    if not body.stream:
        peeked = await _started(engine, internal)
        meta = MessageMeta(id=meta_id, model=name, tools=tools, thinking=thinking)
        return JSONResponse(await message_response(aiter(peeked), meta), headers=headers)
    # message_start reports the prompt's tokens before any is generated: counted once the
    # request is running (a refused one costs no count; a failed count ends the generation).
    peeked = await _started(engine, internal)
    try:
        prompt_ids = await engine.tokenize(internal.prompt)
    except BaseException:
        await peeked.aclose()
        raise
    meta = MessageMeta(id=meta_id, model=name, tools=tools, input_tokens=len(prompt_ids),
                       thinking=thinking)
    return StreamingResponse(sse(message_events(aiter(peeked), meta)),
                             media_type="text/event-stream", headers=headers)


async def _started(engine: EngineClient, request: GenerateRequest) -> Peeked:
    peeked = await peek(engine.generate(request))
    if peeked.error is not None:
        raise from_event(peeked.error)
    return peeked


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict:
    body = decode_body(await request.body(), CountTokensRequest)
    _, engine = _resolve(request.app.state.registry, body.model)
    prompt, _, _ = chat_prompt(body)
    return {"input_tokens": len(await engine.tokenize(prompt))}

"""OpenAI's Responses API: ``POST /v1/responses``, whole or streamed, stateless
(docs/protocols/responses.md). Streams are peeked: a refused request gets its status."""

from __future__ import annotations

import time
import uuid

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from protocols.contract import ModelDirectory
from protocols.internal import ModelNotFound, ModelRequired
from protocols.jsonbody import BodyError, decode_json
from protocols.openai.errors import OpenAIError, from_event
from protocols.responses.encode import ResponseMeta, response_events, response_object, sse
from protocols.responses.schemas import ResponsesRequest
from protocols.responses.translate import responses_request
from protocols.streams import peek
from protocols.tools import grammar_refusal

__all__ = ["router"]

router = APIRouter()


def _decode(raw: bytes) -> ResponsesRequest:
    if not raw.strip():
        raise OpenAIError(400, "request body is empty; expected a JSON object")
    try:
        return decode_json(raw, ResponsesRequest)
    except BodyError as exc:
        raise OpenAIError(400, f"malformed JSON body: {exc}") from None
    except msgspec.ValidationError as exc:
        raise OpenAIError(400, f"invalid request: {exc}") from None


def _echo(body: ResponsesRequest) -> dict:
    """The request parameters a response object repeats."""
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
            "metadata": body.metadata or {}}


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    body = _decode(await request.body())
    models: ModelDirectory = request.app.state.registry
    try:
        name, engine = models.resolve(body.model)
    except ModelNotFound as exc:
        raise OpenAIError(404, str(exc), "model") from None
    except ModelRequired as exc:
        raise OpenAIError(400, str(exc), "model") from None
    response_id = f"resp_{uuid.uuid4().hex}"
    internal, tools = responses_request(body, name, response_id)
    if internal.controller is not None and (refusal := await grammar_refusal(models, name)):
        raise OpenAIError(400, refusal, "tools" if tools.mode != "none" else "text")
    peeked = await peek(engine.generate(internal))
    if peeked.error is not None:
        raise from_event(peeked.error)
    meta = ResponseMeta(id=response_id, created_at=int(time.time()), model=name, tools=tools,
                        echo=_echo(body))
    if body.stream:
        return StreamingResponse(sse(response_events(aiter(peeked), meta)),
                                 media_type="text/event-stream")
    return JSONResponse(await response_object(aiter(peeked), meta))

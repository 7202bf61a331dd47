"""Step 1 of docs/extending.md "Add a protocol": a route that decodes its body, resolves the
model, runs one GenerateRequest, answers a refusal as a status and encodes the events (whole, or
streamed as lines)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from contract import (
    BacktrackEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    ForkEvent,
    GenerateRequest,
    ModelNotFound,
    ModelRequired,
    OutputOptions,
    Sampling,
    TextPrompt,
    TokenEvent,
    as_error,
)
from protocols.spec import options_of
from protocols.streams import peek
from tests.recipes.toy_protocol.errors import ToyError

router = APIRouter()


class ToyOptions(msgspec.Struct):
    """Step 3: options named by GatewayConfig keys."""

    timeout_s: float | None = msgspec.field(default=None, name="request_timeout_s")


class ToyBody(msgspec.Struct):
    text: str
    model: str | None = None
    max_tokens: int = 8
    stream: bool = False


@router.post("/toy/generate")
async def generate(request: Request) -> Response:
    try:
        body = msgspec.json.decode(await request.body(), type=ToyBody)
    except msgspec.DecodeError as exc:
        raise ToyError(400, f"bad body: {exc}") from None
    if body.max_tokens < 1:
        raise ToyError(400, "max_tokens must be at least 1")
    try:
        name, engine = request.app.state.registry.resolve(body.model)
    except (ModelNotFound, ModelRequired) as exc:
        raise ToyError(404 if isinstance(exc, ModelNotFound) else 400, str(exc)) from None
    internal = GenerateRequest(
        request_id=f"toy-{uuid.uuid4().hex}", model=name, prompt=TextPrompt(text=body.text),
        sampling=Sampling(temperature=0.0, max_tokens=body.max_tokens),
        output=OutputOptions(splices="append"),
        timeout_s=options_of(request, ToyOptions).timeout_s)
    peeked = await peek(engine.generate(internal))
    if peeked.error is not None:
        raise ToyError.of(peeked.error)
    if body.stream:
        return StreamingResponse(_lines(aiter(peeked)), media_type="text/plain")
    text, reason = "", None
    async for event in aiter(peeked):
        if isinstance(event, ErrorEvent | BacktrackEvent | ForkEvent):
            raise ToyError.of(as_error(event))
        if isinstance(event, TokenEvent | FinalEvent):
            text += event.text
        if isinstance(event, FinalEvent):
            reason = event.finish_reason
    return JSONResponse({"text": text, "finish_reason": reason})


async def _lines(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """Step 1's encoder: events in, wire chunks out; a splice it cannot show ends it."""
    async for event in events:
        if isinstance(event, ErrorEvent | BacktrackEvent | ForkEvent):
            yield f"error: {as_error(event).message}\n".encode()
            return
        if isinstance(event, TokenEvent) and event.text:
            yield f"token: {event.text}\n".encode()
        elif isinstance(event, FinalEvent):
            yield f"end: {event.finish_reason}\n".encode()

"""MindIE / Triton v2 ``generate`` and ``generate_stream``, plus the KServe v2 probes clients send.

Streams are peeked, so errors
found before the first token are plain JSON with a real status, even on ``generate_stream``.
"""

from __future__ import annotations

import uuid

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from contract.client import EngineClient
from protocols.errors import EnvelopeError
from protocols.jsonbody import BodyError, decode_json
from protocols.mindie.encode import ResponseMeta, collect_response, sse, stream_events
from protocols.mindie.errors import NOT_FOUND, from_event
from protocols.mindie.validate import to_request
from protocols.spec import options_of
from protocols.streams import peek

__all__ = ["MindIEOptions", "router"]

router = APIRouter()


class MindIEOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What MindIE's routes read of the gateway's configuration (each field's ``name`` is its
    key there, docs/configuration.md)."""

    # MindIE's fullTextEnabled: generate_stream events carry the cumulative text, not deltas.
    full_text: bool = msgspec.field(default=False, name="mindie_full_text")


def _resolve(request: Request, model: str) -> tuple[str, EngineClient]:
    try:
        return request.app.state.registry.resolve(model)
    except LookupError:
        raise EnvelopeError(404, f"Model {model} not found.", NOT_FOUND) from None


async def _start(request: Request, model: str, stream: bool):
    try:
        body = decode_json(await request.body())
    except BodyError as exc:
        raise EnvelopeError(422, f"Invalid JSON body: {exc}", "validation") from None
    name, engine = _resolve(request, model)
    adapter = _adapter_id(body)
    if adapter is not None:  # or the adapter's name in the path, as a model's
        try:
            name, engine = request.app.state.registry.resolve_adapter(name, adapter)
        except LookupError as exc:
            raise EnvelopeError(404, str(exc), NOT_FOUND) from None
    info = await request.app.state.registry.info(name)
    internal, options = to_request(body, name, info.vocab_size, uuid.uuid4().hex[:16],
                                   stream=stream)
    peeked = await peek(engine.generate(internal))
    if peeked.error is not None:
        raise from_event(peeked.error)
    meta = ResponseMeta(id=options.id, model=model, details=options.details,
                        full_text=options_of(request, MindIEOptions).full_text)
    return meta, peeked


def _adapter_id(body: object) -> str | None:
    """``parameters.adapter_id`` (or top-level, as MindIE's other fields): one LoRA adapter of
    the model in the path (docs/adapters.md)."""
    if not isinstance(body, dict):
        return None
    params = body.get("parameters")
    value = params.get("adapter_id") if isinstance(params, dict) else None
    value = body.get("adapter_id") if value is None else value
    if value is not None and (not isinstance(value, str) or not value):
        raise EnvelopeError(422, f"adapter_id must name one LoRA adapter, got {value!r}.",
                            "validation")
    return value


@router.post("/v2/models/{model}/generate")
async def generate(request: Request, model: str) -> JSONResponse:
    meta, events = await _start(request, model, stream=False)
    return JSONResponse(await collect_response(aiter(events), meta))


@router.post("/v2/models/{model}/generate_stream")
async def generate_stream(request: Request, model: str) -> StreamingResponse:
    meta, events = await _start(request, model, stream=True)
    return StreamingResponse(sse(stream_events(aiter(events), meta)),
                             media_type="text/event-stream")


@router.post("/v2/models/{model}/versions/{version}/generate")
@router.post("/v2/models/{model}/versions/{version}/generate_stream")
async def versioned(model: str, version: str) -> JSONResponse:
    raise EnvelopeError(404, f"Model versions are not supported: send the request to "
                      f"/v2/models/{model}/generate[_stream] without /versions/{version}.",
                      NOT_FOUND)


@router.get("/v2/health/live")
async def live() -> Response:
    return Response(status_code=200)


@router.get("/v2/health/ready")
async def ready(request: Request) -> Response:
    """Ready when any served model's engine answers."""
    healthy = any((await request.app.state.registry.health()).values())
    return Response(status_code=200 if healthy else 503)


@router.get("/v2")
async def server_metadata(request: Request) -> dict:
    return {"name": request.app.title, "version": request.app.version,
            "extensions": ["generate"]}


@router.get("/v2/models/{model}")
async def model_metadata(request: Request, model: str) -> dict:
    name, _ = _resolve(request, model)
    info = await request.app.state.registry.info(name)
    return {"name": model, "versions": ["1"], "platform": info.engine,
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]}


@router.get("/v2/models/{model}/ready")
async def model_ready(request: Request, model: str) -> Response:
    _, engine = _resolve(request, model)
    try:
        await engine.check_health()
    except Exception:
        return Response(status_code=503)
    return Response(status_code=200)

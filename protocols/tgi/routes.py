"""Hugging Face TGI's own routes, so TGI clients work unmodified: ``POST /generate``,
``POST /generate_stream``, the root ``POST /`` (which the strict ``text-generation`` client
calls with the bare server URL; websocket upgrades on ``/`` stay LMTP) and ``GET /info``.

They serve one model: ``GatewayConfig.tgi_model``, or the first configured model.
"""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from contract.client import EngineClient
from protocols.errors import EnvelopeError
from protocols.spec import options_of
from protocols.streams import Peeked
from protocols.textgen.encode import (
    GenerationFailed,
    ResponseMeta,
    SequenceResult,
    TGIWriter,
    best_sequence,
    collect,
    response_body,
    sse,
    stream_objects,
)
from protocols.textgen.params import (
    TGI,
    InvalidParameters,
    decode_body,
    parse_body,
    parse_parameters,
)
from protocols.textgen.serving import (
    STREAM_HEADERS,
    response_meta,
    start_generation,
    with_adapter,
)
from protocols.tgi.errors import from_event, invalid

__all__ = ["TGIOptions", "router"]

router = APIRouter()


class TGIOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What TGI's routes read of the gateway's configuration (each field's ``name`` is its key
    there, docs/configuration.md)."""

    # The model its routes (/generate, /generate_stream, POST /, /info) serve; None: the first.
    model: str | None = msgspec.field(default=None, name="tgi_model")
    # What /info reports as the server's concurrency bound (the gateway's admission bound).
    max_concurrent_requests: int = 512

_WRITER = TGIWriter()


def _model(request: Request) -> tuple[str, EngineClient]:
    registry = request.app.state.registry
    name = options_of(request, TGIOptions).model or registry.names()[0]
    try:
        return registry.resolve(name)
    except LookupError:
        raise EnvelopeError(404, f"Model {name} is not served.", "not_found") from None


async def _start(request: Request, stream: bool | None
                 ) -> tuple[Peeked, ResponseMeta, bool, str]:
    """Validate and submit; ``stream`` None means "as the body says" (the root route).
    Returns the peeked stream, what shapes the answer, whether to stream, and the model."""
    name, engine = _model(request)
    try:
        body = decode_body(await request.body())
        inputs, params, body_stream = parse_body(body, allow_list=False)
        stream = bool(body_stream) if stream is None else stream
        gen = parse_parameters(params, TGI, stream=stream)
    except InvalidParameters as exc:
        raise invalid(str(exc)) from None
    assert isinstance(inputs, str)
    try:
        name, engine = with_adapter(request.app.state.registry, name, engine, gen.adapter)
        meta = await response_meta(request.app.state.registry, name, inputs, gen)
        peeked = await start_generation(engine, name, inputs, gen)
    except GenerationFailed as exc:
        raise from_event(exc.event) from None
    return peeked, meta, stream, name


def _stream(peeked: Peeked, meta: ResponseMeta) -> StreamingResponse:
    # As TGI: the last event's `details` is null unless `details` was asked for.
    return StreamingResponse(sse(stream_objects(aiter(peeked), meta, _WRITER), space=False),
                             media_type="text/event-stream", headers=STREAM_HEADERS)


def _timing_headers(best: SequenceResult, started: float, engine: str) -> dict[str, str]:
    """TGI's optional per-request headers (milliseconds); ``x-compute-type`` names the engine
    kind."""
    final = best.final
    assert final is not None
    total_ms = (time.monotonic() - started) * 1000
    queue_ms = final.timings.queue_s * 1000
    generated = final.usage.completion_tokens
    return {"x-compute-type": engine, "x-total-time": str(round(total_ms)),
            "x-queue-time": str(round(queue_ms)),
            "x-inference-time": str(round(max(0.0, total_ms - queue_ms))),
            "x-time-per-token": str(round(max(0.0, total_ms - queue_ms) / max(generated, 1))),
            "x-prompt-tokens": str(final.usage.prompt_tokens),
            "x-generated-tokens": str(generated)}


async def _generate(request: Request, wrap: bool) -> JSONResponse | StreamingResponse:
    started = time.monotonic()
    peeked, meta, stream, name = await _start(request, False if not wrap else None)
    if stream:
        return _stream(peeked, meta)
    try:
        prompt, sequences = await collect(aiter(peeked))
    except GenerationFailed as exc:
        raise from_event(exc.event) from None
    out = response_body(prompt, sequences, meta, _WRITER)
    best = best_sequence(sequences)
    engine = (await request.app.state.registry.info(name)).engine
    return JSONResponse([out] if wrap else out, headers=_timing_headers(best, started, engine))


@router.post("/generate")
async def generate(request: Request) -> Response:
    return await _generate(request, wrap=False)


@router.post("/")
async def compat_generate(request: Request) -> Response:
    """TGI's root route: a one-element JSON list, or the SSE stream when ``stream`` is true."""
    return await _generate(request, wrap=True)


@router.post("/generate_stream")
async def generate_stream(request: Request) -> StreamingResponse:
    peeked, meta, _, _ = await _start(request, True)
    return _stream(peeked, meta)


@router.get("/info")
async def info(request: Request) -> dict:
    name, _ = _model(request)
    model = await request.app.state.registry.info(name)
    return {"model_id": name, "model_sha": None, "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": options_of(request, TGIOptions).max_concurrent_requests,
            "max_best_of": TGI.max_best_of, "max_stop_sequences": TGI.max_stop_sequences,
            "max_input_tokens": model.max_model_len - 1, "max_total_tokens": model.max_model_len,
            "max_top_n_tokens": TGI.max_top_n_tokens, "router": "llm-gateway",
            "version": request.app.version, "sha": None, "docker_label": None}

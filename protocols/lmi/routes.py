"""SageMaker / DJL Serving LMI routes: ``/invocations``, ``/predictions/{model}``,
``/models/{model}/invoke``, ``/models`` and SageMaker's ``/ping``.

A body with ``inputs`` is LMI (a string: rolling batch; a list: dynamic batch); ``prompt`` or
``messages`` is an OpenAI completion or chat request, as newer LMI containers dispatch it.
Streams are peeked, so a request the engine refuses gets a real status, never a 200 stream.
The app must carry ``app.state.registry`` and LMI's options (:class:`LMIOptions`,
``protocols.spec.options_of``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from contract import ModelNotFound, ModelRequired
from contract.client import EngineClient, ModelDirectory
from protocols.lmi.errors import (
    dynamic_error,
    frontend_error,
    generation_error,
    payload_error,
)
from protocols.openai import serving as openai_serving
from protocols.spec import options_of
from protocols.streams import Peeked
from protocols.textgen.encode import (
    GenerationFailed,
    LMIWriter,
    TGIWriter,
    best_sequence,
    collect,
    dynamic_lines,
    gather_or_cancel,
    jsonlines,
    response_body,
    sse,
    stream_objects,
)
from protocols.textgen.params import (
    LMI,
    LMI_TGI_COMPAT,
    Generation,
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

__all__ = ["LMIOptions", "router"]

router = APIRouter()


class LMIOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What LMI's routes read of the gateway's configuration (each field's ``name`` is its key
    there, docs/configuration.md)."""

    # option.tgi_compat: /invocations answers in TGI's shapes (a list; SSE streams).
    tgi_compat: bool = msgspec.field(default=False, name="lmi_tgi_compat")
    # option.output_formatter: how a stream is framed when the client's Accept does not say.
    output_formatter: Literal["jsonlines", "sse"] = msgspec.field(
        default="jsonlines", name="lmi_output_formatter")
    # Sequences one request may ask for (inputs times n), over every protocol.
    max_fanout: int = 256

ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
_NO_PAYLOAD = "Input parsing failed: invalid payload. must contain prompt, inputs, or messages"


def _resolve(request: Request, name: Any) -> tuple[str, EngineClient]:
    if name is not None and not isinstance(name, str):
        raise frontend_error(400, "BadRequestException",
                             f"model_name must be a string, got {name!r}.")
    try:
        return request.app.state.registry.resolve(name)
    except ModelNotFound:
        raise frontend_error(404, "ModelNotFoundException", f"Model not found: {name}") from None
    except ModelRequired:
        raise frontend_error(400, "BadRequestException",
                             "Parameter model_name is required.") from None


def _with_adapter(request: Request, name: str, engine: EngineClient, adapter: str | None,
                  param: str) -> tuple[str, EngineClient]:
    """Model ``name`` running ``adapter``; one it lacks is LMI's 404 (as a model not found)."""
    try:
        return with_adapter(request.app.state.registry, name, engine, adapter, param)
    except GenerationFailed as exc:
        raise frontend_error(404, "ModelNotFoundException", exc.event.message) from None


async def _decode(request: Request) -> Any:
    try:
        return decode_body(await request.body())
    except InvalidParameters as exc:
        raise payload_error(f"Input parsing failed: {exc}") from None


@router.post("/invocations")
async def invocations(request: Request):
    """SageMaker's contract: the model comes from ``model_name`` (query, header or body field),
    or is the only one served."""
    body = await _decode(request)
    name = (request.query_params.get("model_name") or request.headers.get("model_name")
            or (body.get("model_name") if isinstance(body, dict) else None))
    return await _invoke(request, body, name)


@router.post("/predictions/{model}")
@router.post("/predictions/{model}/{version}")
@router.post("/models/{model}/invoke")
async def predictions(request: Request, model: str, version: str | None = None):
    """DJL's routes; one version per model is served, so ``version`` only has to be there."""
    return await _invoke(request, await _decode(request), model)


async def _invoke(request: Request, body: Any, name: str | None):
    name, engine = _resolve(request, name)
    if not isinstance(body, dict):
        raise payload_error(_NO_PAYLOAD)
    # SageMaker's way to pick an adapter (inference components); LMI's own is the body's
    # `adapters`, read with the parameters.
    adapter = request.headers.get(ADAPTER_HEADER) or None
    # The model must have it (whatever else the registry serves), checked before the body.
    name, engine = _with_adapter(request, name, engine, adapter, ADAPTER_HEADER)
    if "inputs" in body:
        return await _lmi(request, body, name, engine, picked=adapter is not None)
    # OpenAI-shaped bodies name the adapter as their model (docs/adapters.md).
    model = adapter or name
    if "messages" in body:
        return await _openai(request, openai_serving.chat_completions, {**body, "model": model})
    if "prompt" in body:
        return await _openai(request, openai_serving.completions, {**body, "model": model})
    raise payload_error(_NO_PAYLOAD)


async def _openai(request: Request,
                  handler: Callable[[dict, ModelDirectory, int],
                                    Awaitable[openai_serving.Result]],
                  body: dict) -> Response:
    """An OpenAI-shaped body, answered by OpenAI's serving layer as newer LMI containers do
    (OpenAI's shapes and errors, ``x-request-id`` echoed)."""
    result = await handler(body, request.app.state.registry,
                           options_of(request, LMIOptions).max_fanout)
    return openai_serving.as_response(result, request.headers.get("x-request-id"))


def _wants_sse(request: Request, default_formatter: str) -> bool:
    accept = request.headers.get("accept", "")
    if "text/event-stream" in accept:
        return True
    if "jsonlines" in accept:
        return False
    return default_formatter == "sse"


async def _lmi(request: Request, body: dict, name: str, engine: EngineClient, picked: bool):
    """``picked``: the header already chose ``engine``'s adapter (it wins over the body's)."""
    options = options_of(request, LMIOptions)
    compat = options.tgi_compat
    dynamic = isinstance(body.get("inputs"), list)
    try:
        inputs, params, stream = parse_body(body, allow_list=True)
        gen = parse_parameters(params, LMI_TGI_COMPAT if compat else LMI, stream=bool(stream))
    except InvalidParameters as exc:
        raise (dynamic_error if dynamic else payload_error)(str(exc)) from None
    if not picked:
        name, engine = _with_adapter(request, name, engine, gen.adapter, "adapters")
    if isinstance(inputs, list):
        per_input = max(gen.sampling.n, gen.sampling.best_of or 1)
        if len(inputs) * per_input > options.max_fanout:
            raise dynamic_error(f"{len(inputs)} inputs x {per_input} sequences each; at most "
                                f"{options.max_fanout} are allowed per request")
        return await _dynamic(engine, name, inputs, gen, stream=bool(stream))
    writer = TGIWriter(with_inputs=True) if compat else LMIWriter()
    try:
        meta = await response_meta(request.app.state.registry, name, inputs, gen)
        peeked = await start_generation(engine, name, inputs, gen)
    except GenerationFailed as exc:
        raise generation_error(exc.event) from None
    if stream:
        objects = stream_objects(aiter(peeked), meta, writer)
        # TGI-compatible mode only changes the default framing to SSE (the seed's `data: `).
        if _wants_sse(request, "sse" if compat else options.output_formatter):
            return StreamingResponse(sse(objects, space=True), media_type="text/event-stream",
                                     headers=STREAM_HEADERS)
        return StreamingResponse(jsonlines(objects), media_type="application/jsonlines",
                                 headers=STREAM_HEADERS)
    try:
        prompt, sequences = await collect(aiter(peeked))
    except GenerationFailed as exc:
        raise generation_error(exc.event) from None
    out = response_body(prompt, sequences, meta, writer)
    return JSONResponse([out] if compat else out)


async def _dynamic(engine: EngineClient, name: str, inputs: list[str], gen: Generation,
                   stream: bool):
    """Dynamic batch: one engine request per input, answered in input order. The first failure
    aborts every other input's engine request."""
    peeked = await _start_all(engine, name, inputs, gen)
    if stream:
        return StreamingResponse(jsonlines(_dynamic_stream(peeked)),
                                 media_type="application/jsonlines", headers=STREAM_HEADERS)
    try:
        results = await gather_or_cancel([collect(aiter(p)) for p in peeked])
    except GenerationFailed as exc:
        raise dynamic_error(str(exc)) from None
    finally:
        await asyncio.gather(*(p.aclose() for p in peeked), return_exceptions=True)
    return JSONResponse([
        {"generated_text": (text if gen.return_full_text else "") + best_sequence(seqs).text}
        for text, (_, seqs) in zip(inputs, results, strict=True)
    ])


async def _start_all(engine: EngineClient, name: str, inputs: list[str],
                     gen: Generation) -> list[Peeked]:
    tasks = [asyncio.ensure_future(start_generation(engine, name, text, gen)) for text in inputs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as exc:  # a refusal, or the client went away: close what started
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        started = [t.result() for t in tasks
                   if t.done() and not t.cancelled() and t.exception() is None]
        await asyncio.gather(*(p.aclose() for p in started), return_exceptions=True)
        if isinstance(exc, GenerationFailed):
            raise dynamic_error(str(exc)) from None
        raise


async def _dynamic_stream(streams: list[Peeked]) -> AsyncIterator[dict]:
    try:
        async for line in dynamic_lines(streams):
            yield line
    except GenerationFailed as exc:  # the 200 is already sent: the error is the last line
        yield dynamic_error(str(exc)).body


@router.get("/ping")
async def ping(request: Request) -> JSONResponse:
    """SageMaker's health check: 200 when every model answers, else 500; a status map."""
    health = await request.app.state.registry.health()
    status = {n: "Healthy" if ok else "Unhealthy" for n, ok in health.items()}
    return JSONResponse(status, status_code=200 if all(health.values()) else 500)


@router.get("/models")
async def list_models(request: Request) -> dict:
    """DJL's management listing (its test client reads the model name from here)."""
    registry = request.app.state.registry
    infos = await asyncio.gather(*(registry.info(n) for n in registry.names()))
    return {"models": [{"modelName": n, "modelUrl": i.root, "status": "READY"}
                       for n, i in zip(registry.names(), infos, strict=True)]}


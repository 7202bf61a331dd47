"""SageMaker / DJL Serving LMI routes: ``/invocations``, ``/predictions/{model}``,
``/models/{model}/invoke``, ``/models`` and SageMaker's ``/ping``.

A body with ``inputs`` is LMI (a string: rolling batch; a list: dynamic batch); ``prompt`` or
``messages`` is an OpenAI completion or chat request, as newer LMI containers dispatch it.
Streams are peeked, so a request the engine refuses gets a real status, never a 200 stream.
The app must carry ``app.state.registry`` and ``app.state.config`` (a ``GatewayConfig``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from protocols.internal import EngineClient, GenerateRequest, TextPrompt, TokenPrompt
from protocols.lmi.encode import (
    GenerationFailed,
    LMIWriter,
    ResponseMeta,
    TGIWriter,
    collect,
    dynamic_lines,
    jsonlines,
    response_body,
    sse,
    stream_objects,
)
from protocols.lmi.errors import (
    dynamic_error,
    frontend_error,
    generation_error,
    payload_error,
)
from protocols.lmi.params import (
    LMI,
    LMI_TGI_COMPAT,
    Generation,
    InvalidParameters,
    parse_body,
    parse_parameters,
)
from protocols.streams import Peeked, peek

__all__ = ["router", "start_generation"]

router = APIRouter()

_STREAM_HEADERS = {"Cache-Control": "no-cache"}
_NO_PAYLOAD = "Input parsing failed: invalid payload. must contain prompt, inputs, or messages"


async def start_generation(engine: EngineClient, model: str, inputs: str,
                           gen: Generation) -> Peeked:
    """Submit one prompt and peek its first event. Raises :class:`GenerationFailed`."""
    prompt: TextPrompt | TokenPrompt = TextPrompt(text=inputs)
    if gen.truncate is not None:  # TGI / lmi-dist `truncate`: keep the last N prompt tokens
        ids = await engine.tokenize(prompt)
        if len(ids) > gen.truncate:
            prompt = TokenPrompt(token_ids=ids[-gen.truncate:])
    request = GenerateRequest(request_id=uuid.uuid4().hex, model=model, prompt=prompt,
                              sampling=gen.sampling, output=gen.output)
    peeked = await peek(engine.generate(request))
    if peeked.error is not None:
        raise GenerationFailed(peeked.error)
    return peeked


def _resolve(request: Request, name: str | None) -> tuple[str, EngineClient]:
    from gateway.registry import ModelNotFound, ModelRequired

    try:
        return request.app.state.registry.resolve(name)
    except ModelNotFound:
        raise frontend_error(404, "ModelNotFoundException", f"Model not found: {name}") from None
    except ModelRequired:
        raise frontend_error(400, "BadRequestException",
                             "Parameter model_name is required.") from None


async def _decode(request: Request) -> Any:
    try:
        return msgspec.json.decode(await request.body())
    except (msgspec.DecodeError, RecursionError) as exc:
        raise payload_error(f"Input parsing failed: invalid JSON: {exc}") from None


def _with_body(request: Request, body: dict) -> Request:
    """The same HTTP request carrying another JSON body (for the OpenAI handlers)."""
    data = msgspec.json.encode(body)

    async def receive() -> dict:
        return {"type": "http.request", "body": data, "more_body": False}

    return Request(request.scope, receive)


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
    if request.headers.get("x-amzn-sagemaker-adapter-identifier"):
        raise payload_error("LoRA adapters are not served here "
                            "(X-Amzn-SageMaker-Adapter-Identifier).")
    if "inputs" in body:
        return await _lmi(request, body, name, engine)
    from protocols.openai import routes as openai_routes

    if "messages" in body:
        return await openai_routes.chat_completions(_with_body(request, {**body, "model": name}))
    if "prompt" in body:
        return await openai_routes.completions(_with_body(request, {**body, "model": name}))
    raise payload_error(_NO_PAYLOAD)


def _wants_sse(request: Request, default_formatter: str) -> bool:
    accept = request.headers.get("accept", "")
    if "text/event-stream" in accept:
        return True
    if "jsonlines" in accept:
        return False
    return default_formatter == "sse"


async def _lmi(request: Request, body: dict, name: str, engine: EngineClient):
    config = request.app.state.config
    compat = config.lmi_tgi_compat
    try:
        inputs, params, stream = parse_body(body, allow_list=True)
        gen = parse_parameters(params, LMI_TGI_COMPAT if compat else LMI, stream=bool(stream))
    except InvalidParameters as exc:
        raise payload_error(str(exc)) from None
    if isinstance(inputs, list):
        return await _dynamic(engine, name, inputs, gen, stream=bool(stream))
    info = await request.app.state.registry.info(name)
    meta = ResponseMeta(inputs=inputs, details=gen.details, return_full_text=gen.return_full_text,
                        prefill=gen.prefill, top_n_tokens=gen.top_n_tokens, seed=gen.seed,
                        eos_token_id=info.eos_token_id)
    writer = TGIWriter(with_inputs=True) if compat else LMIWriter()
    try:
        peeked = await start_generation(engine, name, inputs, gen)
    except GenerationFailed as exc:
        raise generation_error(exc.event) from None
    if stream:
        objects = stream_objects(aiter(peeked), meta, writer)
        if compat or _wants_sse(request, config.lmi_output_formatter):
            return StreamingResponse(sse(objects, space=not compat),
                                     media_type="text/event-stream", headers=_STREAM_HEADERS)
        return StreamingResponse(jsonlines(objects), media_type="application/jsonlines",
                                 headers=_STREAM_HEADERS)
    try:
        prompt, sequences = await collect(aiter(peeked))
    except GenerationFailed as exc:
        raise generation_error(exc.event) from None
    out = response_body(prompt, sequences, meta, writer)
    return JSONResponse([out] if compat else out)


async def _dynamic(engine: EngineClient, name: str, inputs: list[str], gen: Generation,
                   stream: bool):
    """Dynamic batch: one engine request per input, answered in input order."""
    started = await asyncio.gather(*(start_generation(engine, name, text, gen) for text in inputs),
                                   return_exceptions=True)
    failure = next((s for s in started if isinstance(s, BaseException)), None)
    if failure is not None:
        await asyncio.gather(*(s.aclose() for s in started if isinstance(s, Peeked)),
                             return_exceptions=True)
        if not isinstance(failure, Exception):
            raise failure
        raise dynamic_error(str(failure)) from None
    peeked: list[Peeked] = started  # type: ignore[assignment]
    if stream:
        return StreamingResponse(jsonlines(_dynamic_stream([aiter(p) for p in peeked])),
                                 media_type="application/jsonlines", headers=_STREAM_HEADERS)
    results = await asyncio.gather(*(collect(aiter(p)) for p in peeked), return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        raise dynamic_error(str(failure)) from None
    plain = ResponseMeta(inputs="", details=False)
    return JSONResponse([
        {"generated_text": (text if gen.return_full_text else "")
         + response_body(prompt, seqs, plain, LMIWriter())["generated_text"]}
        for text, (prompt, seqs) in zip(inputs, results, strict=True)  # type: ignore[misc]
    ])


async def _dynamic_stream(streams: list[AsyncIterator]) -> AsyncIterator[dict]:
    try:
        async for line in dynamic_lines(streams):
            yield line
    except GenerationFailed as exc:  # the 200 is already sent: the error is the last line
        yield dynamic_error(str(exc)).body


@router.get("/models")
async def list_models(request: Request) -> dict:
    """DJL's management listing (its test client reads the model name from here)."""
    registry = request.app.state.registry
    infos = await asyncio.gather(*(registry.info(n) for n in registry.names()))
    return {"models": [{"modelName": n, "modelUrl": i.root, "status": "READY"}
                       for n, i in zip(registry.names(), infos, strict=True)]}


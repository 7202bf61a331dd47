"""AICI's REST API (``docs/protocols/aici.md``, "REST API"): ``POST /v1/run`` streams a controlled generation;
``GET``/``POST /v1/controllers/tags`` list and set controller tags; ``POST /v1/controllers``
(Wasm upload) is refused, as only the engines' registered controllers run here.

Identity comes from ``x-user-id`` (default ``localhost``) and ``x-user-role`` (``admin`` by
default), as AICI's server takes them; the gateway's API key (pyaici sends it as ``api-key``)
is checked before any of this.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from contract import (
    DEADLOCK,
    ControllerSpec,
    GenerateRequest,
    ModelInfo,
    OutputOptions,
    Sampling,
    TextPrompt,
    TokenPrompt,
)
from contract.client import EngineClient, ModelDirectory
from protocols.aici.encode import RunMeta, run_objects, sse
from protocols.aici.errors import APIError, from_event
from protocols.aici.schemas import RunRequest, TagsRequest, decode
from protocols.aici.tags import MAX_USER_TAGS, LocalTagStore, TagStore, check_tags, tag_info
from protocols.controllers import controller_spec
from protocols.streams import peek

__all__ = ["router"]

router = APIRouter()

# Sent as they are streamed: no proxy may buffer the events (AICI's clients print each).
_STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_STARTED = int(time.time())  # built-in tags' updated_at


def _store(request: Request) -> TagStore:
    state = request.app.state
    if getattr(state, "aici_tags", None) is None:
        state.aici_tags = LocalTagStore()
    return state.aici_tags


async def _model(registry: ModelDirectory, name: str | None) -> tuple[str, EngineClient]:
    try:
        if name or len(registry.names()) == 1:
            return registry.resolve(name)
        for candidate in registry.names():  # the first model that runs controllers
            if (await registry.info(candidate)).capabilities.controllers != "none":
                return registry.resolve(candidate)
        return registry.resolve(registry.names()[0])
    except LookupError as exc:
        raise APIError(404, str(exc)) from None


async def _builtin_tags(registry: ModelDirectory) -> dict[str, str]:
    """tag → module id of every controller the served models' engines host."""
    hosted: dict[str, str] = {}
    for name in registry.names():
        for tag in (await registry.info(name)).controllers:
            hosted.setdefault(tag.tag, tag.module_id)
    return hosted


async def _controller(request: Request, run: RunRequest, info: ModelInfo) -> ControllerSpec:
    """The engine's name for the run's controller: a user tag becomes its module id; a
    built-in tag or a module id goes as it is (an unknown one fails in the stream, as an
    instantiate failure does in AICI)."""
    if run.controller.startswith("gh:"):
        raise APIError(400, "controllers are not downloaded here; name a registered tag "
                            "(GET /v1/controllers/tags) or its module id")
    if info.capabilities.controllers == "none":
        raise APIError(400, f"model {info.name!r} runs no controllers; use controller \"none\"")
    user_tag = (await _store(request).tags()).get(run.controller)
    module = user_tag["module_id"] if user_tag else run.controller
    try:
        spec = controller_spec(module, run.controller_arg, field="controller")
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    assert spec is not None
    return spec


@router.post("/v1/run")
async def run(request: Request) -> StreamingResponse:
    body = decode(await request.body(), RunRequest)
    registry: ModelDirectory = request.app.state.registry
    name, engine = await _model(registry, body.model)
    info = await registry.info(name)
    if body.controller == "none":  # plain generation of controller_arg (EOS still ignored)
        try:
            arg = controller_spec("none", body.controller_arg)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        text, controller = body.prompt + (arg.arg if arg else ""), None
    else:
        text, controller = body.prompt, await _controller(request, body, info)
    ids = await engine.tokenize(TextPrompt(text=text))
    if not ids:
        # AICI starts from the tokenizer's BOS; a model that adds none starts from its
        # end-of-text token, which is what such models see between documents.
        if info.eos_token_id is None:
            raise APIError(400, "the prompt is empty and this model has no start token")
        ids = (info.eos_token_id,)
    room = info.max_model_len - len(ids)
    max_tokens = room if body.max_tokens is None else body.max_tokens
    if room < 1 or max_tokens > room:
        raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) is over "
                            f"the context of {info.max_model_len} tokens")
    run_id = f"run-{uuid.uuid4()}"
    internal = GenerateRequest(
        request_id=run_id, model=name, prompt=TokenPrompt(token_ids=tuple(ids)),
        sampling=Sampling(temperature=body.temperature, top_p=body.top_p,
                          top_k=max(body.top_k, 0), max_tokens=max_tokens, ignore_eos=True),
        output=OutputOptions(splices="full"), controller=controller)
    peeked = await peek(engine.generate(internal))
    error = peeked.error
    # A controller that fails to start (or deadlocks before any output) is reported in the
    # stream ("fail" / "deadlock"), as AICI does;
    # anything else (overload, no replica) is an HTTP status.
    if error is not None and not (error.kind == "validation"
                                  and error.param in ("controller", DEADLOCK)):
        raise from_event(error)
    meta = RunMeta(id=run_id, model=name, created=int(time.time()), prompt_tokens=len(ids),
                   controlled=controller is not None)
    return StreamingResponse(sse(run_objects(aiter(peeked), meta)),
                             media_type="text/event-stream", headers=_STREAM_HEADERS)


@router.get("/v1/controllers/tags")
async def list_tags(request: Request) -> dict:
    user = await _store(request).tags()
    builtin = [tag_info(tag, module_id, "builtin", _STARTED) for tag, module_id
               in (await _builtin_tags(request.app.state.registry)).items() if tag not in user]
    # Newest first; within one second, the later set first (the store keeps set order).
    tags = [*reversed(user.values()), *builtin]
    return {"tags": sorted(tags, key=lambda t: t["updated_at"], reverse=True)}


@router.post("/v1/controllers/tags")
async def set_tags(request: Request) -> dict:
    body = decode(await request.body(), TagsRequest)
    user = request.headers.get("x-user-id", "localhost")
    admin = request.headers.get("x-user-role", "admin") == "admin"
    builtin = await _builtin_tags(request.app.state.registry)
    if body.module_id not in set(builtin.values()):
        raise APIError(400, f"unknown module_id {body.module_id!r}: tags name the module ids "
                            f"GET /v1/controllers/tags lists")
    why = check_tags(body.tags, user, admin, set(builtin))
    if why is not None:
        raise APIError(400, why)  # AICI: a user error, permission included
    store = _store(request)
    known = await store.tags()
    if len(known.keys() | set(body.tags)) > MAX_USER_TAGS:
        raise APIError(400, f"at most {MAX_USER_TAGS} tags are kept; reuse a name")
    infos = [tag_info(tag, body.module_id, user) for tag in body.tags]
    await store.set(infos)
    return {"tags": infos}


@router.post("/v1/controllers")
async def upload(request: Request) -> JSONResponse:
    hosted = sorted(await _builtin_tags(request.app.state.registry))
    raise APIError(400, "uploading Wasm controllers is not supported by this gateway; run one "
                        f"of the registered controllers by tag: {', '.join(hosted) or 'none'}")

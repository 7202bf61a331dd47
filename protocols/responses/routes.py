"""OpenAI's Responses API: ``POST /v1/responses``, whole or streamed, stored unless ``store`` is
false and continued by ``previous_response_id``; ``GET`` / ``DELETE /v1/responses/{id}`` and its
``input_items`` (docs/protocols/responses.md). Streams are peeked: a refused request gets its
status."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from contract import ModelNotFound, ModelRequired
from contract.client import ModelDirectory
from protocols.jsonbody import BodyError, decode_json
from protocols.openai.errors import OpenAIError, from_event
from protocols.responses.encode import ResponseMeta, response_events, response_object, sse
from protocols.responses.schemas import ResponsesRequest
from protocols.responses.store import ResponseStore, StoredResponse
from protocols.responses.translate import input_items, responses_request
from protocols.streams import peek
from protocols.tools import grammar_refusal

__all__ = ["router"]

router = APIRouter()
log = logging.getLogger(__name__)


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
    store: ResponseStore | None = request.app.state.response_store
    context = await _context(store, body.previous_response_id)
    response_id = f"resp_{uuid.uuid4().hex}"
    internal, tools = responses_request(body, name, response_id, context)
    if internal.controller is not None and (refusal := await grammar_refusal(models, name)):
        raise OpenAIError(400, refusal, "tools" if tools.mode != "none" else "text")
    peeked = await peek(engine.generate(internal))
    if peeked.error is not None:
        raise from_event(peeked.error)
    keep = store if body.store is not False else None
    meta = ResponseMeta(id=response_id, created_at=int(time.time()), model=name, tools=tools,
                        echo={**_echo(body), "store": keep is not None,
                              "previous_response_id": body.previous_response_id})
    stored = functools.partial(_stored, input_items(body), context)
    if body.stream:
        events = response_events(aiter(peeked), meta)
        if keep is not None:
            events = _kept(events, keep, stored)
        return StreamingResponse(sse(events), media_type="text/event-stream")
    response = await response_object(aiter(peeked), meta)
    if keep is not None:
        await _put(keep, stored(response))
    return JSONResponse(response)


async def _put(store: ResponseStore, stored: StoredResponse) -> None:
    # The answer is made: a store that fails (its actor restarting) must not withhold it.
    try:
        kept = await store.put(stored)
    except Exception:
        log.exception("storing response %s failed", stored.response["id"])
        return
    if not kept:
        log.warning("response %s not stored: larger than the whole store",
                    stored.response["id"])


async def _ask(store: ResponseStore | None, method: str, response_id: str) -> Any:
    """``store.<method>(response_id)``; a store that cannot be reached is a 503."""
    if store is None:
        return None
    try:
        return await getattr(store, method)(response_id)
    except Exception:
        log.exception("%s of stored response %s failed", method, response_id)
        raise OpenAIError(503, "stored responses are unavailable right now; try again") from None


async def _context(store: ResponseStore | None, previous: str | None) -> list[dict]:
    """The items the response named by ``previous_response_id`` leaves off with."""
    if previous is None:
        return []
    stored = await _ask(store, "get", previous)
    if stored is None:
        raise OpenAIError(404, f"Previous response with id {previous!r} not found.",
                          "previous_response_id")
    return stored.context


def _stored(own: list[dict], context: list[dict], response: dict) -> StoredResponse:
    return StoredResponse(response=response, input_items=own,
                          context=[*context, *own, *response["output"]])


async def _kept(events: AsyncIterator[tuple[str, dict]], store: ResponseStore,
                stored: Callable[[dict], StoredResponse]) -> AsyncIterator[tuple[str, dict]]:
    """The stream, storing the response its last event carries before passing that on."""
    async for name, data in events:
        if name in ("response.completed", "response.incomplete"):
            await _put(store, stored(data["response"]))
        yield name, data


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id {response_id!r} not found.", "response_id")


async def _found(request: Request, response_id: str) -> StoredResponse:
    stored = await _ask(request.app.state.response_store, "get", response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


@router.get("/v1/responses/{response_id}")
async def retrieve(request: Request, response_id: str) -> Response:
    return JSONResponse((await _found(request, response_id)).response)


@router.delete("/v1/responses/{response_id}")
async def delete(request: Request, response_id: str) -> Response:
    if not await _ask(request.app.state.response_store, "delete", response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str, order: str = "desc",
                           limit: int = 20, after: str | None = None) -> Response:
    """The input items the response's own request sent (not its context), in OpenAI's list
    shape."""
    if order not in ("asc", "desc") or not 1 <= limit <= 100:
        raise OpenAIError(400, "order is 'asc' or 'desc'; limit is in [1, 100]",
                          "order" if order not in ("asc", "desc") else "limit")
    stored = await _found(request, response_id)
    items = [_listed(item, f"input_{response_id[5:]}_{i}")
             for i, item in enumerate(stored.input_items)]
    items = items[::-1] if order == "desc" else items
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(items) > limit})


def _listed(item: dict[str, Any], item_id: str) -> dict[str, Any]:
    """An input item as OpenAI lists it: typed, with an id (``item_id`` where the request gave
    none) and a status, a message's text as content parts."""
    listed = {**item, "id": item.get("id") or item_id, "type": item.get("type", "message"),
              "status": item.get("status", "completed")}
    if listed["type"] == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        listed["content"] = [{"type": part, "text": item["content"]}]
    return listed

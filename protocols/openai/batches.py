"""OpenAI's Files and Batch API routes (docs/protocols/batches.md): ``/v1/files`` and
``/v1/batches``, over the :class:`~protocols.openai.batch_objects.BatchService` the gateway
puts in ``app.state.batches``. Refusals are OpenAI's envelope; an id another key made is a 404,
as an id that does not exist."""

from __future__ import annotations

from typing import Annotated

import msgspec
from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response

from protocols.openai.batch_objects import BatchRefused, BatchRequest, BatchService
from protocols.openai.errors import OpenAIError
from protocols.openai.translate import decode_body

__all__ = ["batch_router"]

batch_router = APIRouter()
_LIST_MOST = 100


def _service(request: Request) -> BatchService:
    service = getattr(request.app.state, "batches", None)
    if service is None:
        raise OpenAIError(404, "The Batch API is not enabled on this gateway.")
    return service


def _json(value) -> Response:
    return Response(msgspec.json.encode(value), media_type="application/json")


def _listing(items: list, after: str | None, limit: int) -> Response:
    """OpenAI's cursor page: newest first, ``after`` an id of the previous page."""
    if not 1 <= limit <= _LIST_MOST:
        raise OpenAIError(400, f"limit must be 1 to {_LIST_MOST}, got {limit}", "limit")
    items = sorted(items, key=lambda item: (item.created_at, item.id), reverse=True)
    if after is not None:
        ids = [item.id for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return _json({"object": "list", "data": page, "has_more": len(items) > limit,
                  "first_id": page[0].id if page else None,
                  "last_id": page[-1].id if page else None})


async def _refusals_in_shape(work):
    try:
        return await work
    except BatchRefused as exc:
        raise OpenAIError(exc.status, exc.message, exc.param) from None


def _not_found(kind: str, object_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such {kind}: '{object_id}'", "id")


@batch_router.post("/v1/files")
async def upload_file(request: Request, file: Annotated[UploadFile, File()],
                      purpose: Annotated[str, Form()]) -> Response:
    content = await file.read()
    stored = await _refusals_in_shape(_service(request).put_file(
        file.filename or "upload.jsonl", purpose, content))
    return _json(stored)


@batch_router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = 100) -> Response:
    return _listing(await _service(request).files(purpose), after, limit)


@batch_router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> Response:
    found = await _service(request).file(file_id)
    if found is None:
        raise _not_found("file", file_id)
    return _json(found)


@batch_router.get("/v1/files/{file_id}/content")
async def get_file_content(request: Request, file_id: str) -> Response:
    content = await _service(request).file_content(file_id)
    if content is None:
        raise _not_found("file", file_id)
    return Response(content, media_type="application/jsonl")


@batch_router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> Response:
    if not await _service(request).delete_file(file_id):
        raise _not_found("file", file_id)
    return _json({"id": file_id, "object": "file", "deleted": True})


@batch_router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    body = decode_body(await request.body(), BatchRequest)
    return _json(await _refusals_in_shape(_service(request).create_batch(body)))


@batch_router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> Response:
    return _listing(await _service(request).batches(), after, limit)


@batch_router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> Response:
    found = await _service(request).batch(batch_id)
    if found is None:
        raise _not_found("batch", batch_id)
    return _json(found)


@batch_router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    found = await _refusals_in_shape(_service(request).cancel_batch(batch_id))
    if found is None:
        raise _not_found("batch", batch_id)
    return _json(found)

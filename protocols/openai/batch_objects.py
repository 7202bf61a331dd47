"""OpenAI's Files and Batch API objects, and the checks of a batch's input lines
(docs/protocols/batches.md).

The objects are what ``/v1/files`` and ``/v1/batches`` answer, field for field as OpenAI's
reference shows them; :class:`BatchService` is what the routes need from whoever keeps files
and runs batches (the gateway's: ``gateway.cluster.batches``), already scoped to the calling key.
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec

__all__ = ["BATCH_ENDPOINTS", "BatchError", "BatchErrors", "BatchLine", "BatchObject",
           "BatchRefused", "BatchRequest", "BatchService", "FileObject", "LineProblem", "LineRequest",
           "RequestCounts", "read_line"]

# What a batch's lines may call (each line's "url" must equal the batch's endpoint).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed",
                      "expired", "cancelling", "cancelled"]


class FileObject(msgspec.Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    object: Literal["file"] = "file"
    status: Literal["processed"] = "processed"  # deprecated by OpenAI, still sent
    expires_at: int | None = None


class RequestCounts(msgspec.Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(msgspec.Struct, kw_only=True):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(msgspec.Struct, kw_only=True):
    data: list[BatchError]
    object: Literal["list"] = "list"


class BatchObject(msgspec.Struct, kw_only=True):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    object: Literal["batch"] = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /v1/batches``'s body."""

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class BatchLine(msgspec.Struct, frozen=True, kw_only=True):
    """One line of a batch's input file."""

    custom_id: str
    method: str
    url: str
    body: dict


class LineRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An input line that can run."""

    line: int  # 1-based
    custom_id: str
    body: dict


class LineProblem(msgspec.Struct, frozen=True, kw_only=True):
    """Why one input line cannot run: what the error file says of it."""

    line: int  # 1-based
    custom_id: str | None
    message: str


class BatchRefused(Exception):
    """A batch or file request refused: ``status`` and the message OpenAI's envelope carries."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def read_line(number: int, raw: bytes, endpoint: str) -> LineRequest | LineProblem:
    """Line ``number`` of a batch's input, checked: a request, or what is wrong with it."""
    try:
        line = msgspec.json.decode(raw, type=BatchLine)
    except msgspec.ValidationError as exc:
        custom = _custom_id(raw)
        return LineProblem(line=number, custom_id=custom, message=f"invalid request line: {exc}")
    except msgspec.DecodeError:
        return LineProblem(line=number, custom_id=None, message="the line is not valid JSON")
    if line.method.upper() != "POST":
        return LineProblem(line=number, custom_id=line.custom_id,
                           message=f"method must be POST, got {line.method!r}")
    if line.url != endpoint:
        return LineProblem(line=number, custom_id=line.custom_id, message=(
            f"url {line.url!r} differs from the batch's endpoint {endpoint!r}"))
    if line.body.get("stream"):
        return LineProblem(line=number, custom_id=line.custom_id,
                           message="streamed responses cannot be batched (stream: true)")
    return LineRequest(line=number, custom_id=line.custom_id, body=line.body)


def _custom_id(raw: bytes) -> str | None:
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    custom = value.get("custom_id") if isinstance(value, dict) else None
    return custom if isinstance(custom, str) else None


class BatchService(Protocol):
    """Files and batches of the calling key (another key's are not found: None / False)."""

    async def put_file(self, filename: str, purpose: str, content: bytes) -> FileObject: ...
    async def file(self, file_id: str) -> FileObject | None: ...
    async def files(self, purpose: str | None) -> list[FileObject]: ...
    async def file_content(self, file_id: str) -> bytes | None: ...
    async def delete_file(self, file_id: str) -> bool: ...
    async def create_batch(self, request: BatchRequest) -> BatchObject: ...
    async def batch(self, batch_id: str) -> BatchObject | None: ...
    async def batches(self) -> list[BatchObject]: ...
    async def cancel_batch(self, batch_id: str) -> BatchObject | None: ...

"""Files and batches on disk (docs/protocols/batches.md, "Where batches live").

Under the store's directory::

    files/<file id>.jsonl, files/<file id>.json        a file's content and its record
    batches/<batch id>.json                             a batch's record (its object, owner)
    batches/<batch id>.output.jsonl / .errors.jsonl     results, one line each, appended

Every result line is written and synced before its line counts as done, and its ``id``
(``batch_req_<line>_<random>``) names the input line it answers: after a restart the store reads
the results back and runs only the lines without one, so no line runs twice and none is lost
(a line cut short by a crash is dropped and run again). Records are replaced atomically.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Literal, TypeVar

import msgspec

from gateway.cluster.state import write_atomically
from protocols.openai.batch_objects import (
    BATCH_ENDPOINTS,
    BatchObject,
    BatchRefused,
    BatchRequest,
    FileObject,
    LineProblem,
    LineRequest,
    RequestCounts,
    read_line,
)

__all__ = ["BatchStore", "StoredBatch", "StoredFile", "Tenant"]

T = TypeVar("T")
WINDOW_S = {"24h": 24 * 3600}
ACTIVE = ("in_progress", "cancelling", "finalizing")


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    """Whose batch it is, as the lines run: the key's id and name, its models and budget."""

    owner: str = ""
    name: str = ""
    models: list[str] | None = None
    token_budget: int | None = None
    budget_period: Literal["day", "month"] = "day"


class StoredFile(msgspec.Struct, kw_only=True):
    file: FileObject
    owner: str


class StoredBatch(msgspec.Struct, kw_only=True):
    batch: BatchObject
    tenant: Tenant


def _new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def _read(directory: Path, record_id: str, prefix: str, kind: type[T]) -> T | None:
    """The record ``<record_id>.json`` of ``directory`` (None: no such id, or not one of ours:
    an id from a client never names a path outside it)."""
    if not record_id.startswith(prefix) or "/" in record_id or ".." in record_id:
        return None
    try:
        raw = (directory / f"{record_id}.json").read_bytes()
    except OSError:
        return None
    return msgspec.json.decode(raw, type=kind)


class BatchStore:
    """The files and batches of every key, on disk (module docstring)."""

    def __init__(self, root: str | Path, max_file_bytes: int, max_lines: int):
        self.root = Path(root)
        self.files_dir, self.batches_dir = self.root / "files", self.root / "batches"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes, self.max_lines = max_file_bytes, max_lines

    # --- files ----------------------------------------------------------------------------

    def put_file(self, owner: str, filename: str, purpose: str, content: bytes) -> FileObject:
        if purpose != "batch":
            raise BatchRefused(400, f"purpose must be 'batch' here, got {purpose!r}", "purpose")
        if len(content) > self.max_file_bytes:
            raise BatchRefused(413, f"the file has {len(content)} bytes; at most "
                               f"{self.max_file_bytes} are accepted", "file")
        lines = sum(1 for line in content.splitlines() if line.strip())
        if lines > self.max_lines:
            raise BatchRefused(400, f"the file has {lines} requests; a batch takes at most "
                               f"{self.max_lines}", "file")
        return self._save_file(owner, _new_id("file-"), filename[:255], purpose, content)

    def _save_file(self, owner: str, file_id: str, filename: str, purpose: str,
                   content: bytes) -> FileObject:
        write_atomically(self.files_dir / f"{file_id}.jsonl", content)
        record = FileObject(id=file_id, bytes=len(content), created_at=int(time.time()),
                            filename=filename, purpose=purpose)
        write_atomically(self.files_dir / f"{file_id}.json",
                          msgspec.json.encode(StoredFile(file=record, owner=owner)))
        return record

    def _stored_file(self, file_id: str) -> StoredFile | None:
        return _read(self.files_dir, file_id, "file-", StoredFile)

    def file(self, owner: str, file_id: str) -> FileObject | None:
        stored = self._stored_file(file_id)
        return stored.file if stored is not None and stored.owner == owner else None

    def files(self, owner: str, purpose: str | None = None) -> list[FileObject]:
        found = (msgspec.json.decode(p.read_bytes(), type=StoredFile)
                 for p in self.files_dir.glob("*.json"))
        return [s.file for s in found
                if s.owner == owner and (purpose is None or s.file.purpose == purpose)]

    def content(self, owner: str, file_id: str) -> bytes | None:
        if self.file(owner, file_id) is None:
            return None
        return (self.files_dir / f"{file_id}.jsonl").read_bytes()

    def delete_file(self, owner: str, file_id: str) -> bool:
        if self.file(owner, file_id) is None:
            return False
        (self.files_dir / f"{file_id}.json").unlink(missing_ok=True)
        (self.files_dir / f"{file_id}.jsonl").unlink(missing_ok=True)
        return True

    # --- batches --------------------------------------------------------------------------

    def create_batch(self, tenant: Tenant, request: BatchRequest) -> BatchObject:
        if request.endpoint not in BATCH_ENDPOINTS:
            raise BatchRefused(400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got "
                               f"{request.endpoint!r}", "endpoint")
        if request.completion_window not in WINDOW_S:
            raise BatchRefused(400, "completion_window must be '24h'", "completion_window")
        if request.metadata is not None and len(request.metadata) > 16:
            raise BatchRefused(400, "metadata takes at most 16 pairs", "metadata")
        source = self.file(tenant.owner, request.input_file_id)
        if source is None or source.purpose != "batch":
            raise BatchRefused(404, f"No such file: '{request.input_file_id}'", "input_file_id")
        now = int(time.time())
        batch = BatchObject(
            id=_new_id("batch_"), endpoint=request.endpoint,
            input_file_id=request.input_file_id, completion_window=request.completion_window,
            status="in_progress", created_at=now, in_progress_at=now,
            expires_at=now + WINDOW_S[request.completion_window], metadata=request.metadata)
        lines = self.input_lines(tenant.owner, batch)
        batch.request_counts = RequestCounts(total=len(lines))
        self.save(StoredBatch(batch=batch, tenant=tenant))
        return batch

    def save(self, stored: StoredBatch) -> None:
        write_atomically(self.batches_dir / f"{stored.batch.id}.json",
                          msgspec.json.encode(stored))

    def stored_batch(self, batch_id: str) -> StoredBatch | None:
        return _read(self.batches_dir, batch_id, "batch_", StoredBatch)

    def batch(self, owner: str, batch_id: str) -> BatchObject | None:
        stored = self.stored_batch(batch_id)
        return stored.batch if stored is not None and stored.tenant.owner == owner else None

    def batches(self, owner: str | None = None) -> list[StoredBatch]:
        """Every batch (of ``owner``, if given)."""
        found = [msgspec.json.decode(p.read_bytes(), type=StoredBatch)
                 for p in self.batches_dir.glob("batch_*.json")]
        return [s for s in found if owner is None or s.tenant.owner == owner]

    def input_lines(self, owner: str, batch: BatchObject) -> list[LineRequest | LineProblem]:
        """The batch's input, each line checked; a custom id seen before is a problem."""
        content = self.content(owner, batch.input_file_id) or b""
        lines: list[LineRequest | LineProblem] = []
        seen: set[str] = set()
        for number, raw in enumerate(content.splitlines(), 1):
            if not raw.strip():
                continue
            line = read_line(number, raw, batch.endpoint)
            if isinstance(line, LineRequest):
                if line.custom_id in seen:
                    line = LineProblem(line=number, custom_id=line.custom_id,
                                       message=f"custom_id {line.custom_id!r} is not unique")
                seen.add(line.custom_id)
            lines.append(line)
        return lines

    # --- results ------------------------------------------------------------------------------

    def results_path(self, batch_id: str, kind: str) -> Path:
        return self.batches_dir / f"{batch_id}.{kind}.jsonl"

    def done_lines(self, batch_id: str) -> tuple[set[int], int, int]:
        """The input lines with a result (by number), and how many succeeded and failed; a
        result line cut short by a crash is dropped first."""
        done: set[int] = set()
        counts = []
        for kind in ("output", "errors"):
            path = self.results_path(batch_id, kind)
            raw = path.read_bytes() if path.exists() else b""
            if raw and not raw.endswith(b"\n"):
                raw = raw[:raw.rfind(b"\n") + 1]
                with path.open("r+b") as out:
                    out.truncate(len(raw))
            for line in raw.splitlines():
                request_id = msgspec.json.decode(line)["id"]
                done.add(int(request_id.split("_")[2]))
            counts.append(len(raw.splitlines()))
        return done, counts[0], counts[1]

    def append_result(self, batch_id: str, kind: str, line: int, custom_id: str | None,
                      response: dict | None, error: dict | None) -> None:
        entry = {"id": f"batch_req_{line}_{secrets.token_hex(8)}", "custom_id": custom_id,
                 "response": response, "error": error}
        with self.results_path(batch_id, kind).open("ab") as out:
            out.write(msgspec.json.encode(entry) + b"\n")
            out.flush()
            os.fsync(out.fileno())

    def publish_results(self, stored: StoredBatch, kind: str) -> str | None:
        """The batch's results of ``kind`` as a file of its owner (None: there are none);
        again after a crash, the same file."""
        file_id = f"file-{stored.batch.id.removeprefix('batch_')}-{kind}"
        if self._stored_file(file_id) is not None:
            return file_id
        path = self.results_path(stored.batch.id, kind)
        if not path.exists() or path.stat().st_size == 0:
            return None
        self._save_file(stored.tenant.owner, file_id, f"{stored.batch.id}_{kind}.jsonl",
                        "batch_output", path.read_bytes())
        return file_id

"""Running batches (docs/protocols/batches.md, "How a batch runs").

:class:`BatchRunner` takes the active batches oldest first and sends each line that has no
result yet through ``send`` (the gateway's own app, in this process: the same translation,
chat templates and tools as an interactive request), at most ``concurrency`` lines at a time,
as its owner's key at the batch tier (below every key's, so interactive traffic keeps its
latency). A line the engines could not take (429, 5xx: overloaded, a replica restarting) is
sent again after a pause, up to :data:`ATTEMPTS` times; any other answer is its result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from gateway.cluster.batches.store import ACTIVE, BatchStore, StoredBatch, Tenant
from protocols.openai.batch_objects import BatchObject, LineProblem, LineRequest, RequestCounts

__all__ = ["ATTEMPTS", "BatchRunner", "Send"]

log = logging.getLogger(__name__)

ATTEMPTS = 6
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# send(tenant, endpoint, body) -> (status, JSON body, request id)
Send = Callable[[Tenant, str, dict], Awaitable[tuple[int, dict, str]]]


class BatchRunner:
    def __init__(self, store: BatchStore, send: Send, concurrency: int = 8,
                 retry_pause_s: float = 1.0):
        self.store = store
        self.send = send
        self.concurrency = concurrency
        self.retry_pause_s = retry_pause_s
        self.wake = asyncio.Event()  # set when a batch is made or cancelled
        # The running batch's results so far: (completed, failed), for its request_counts.
        self.progress: dict[str, list[int]] = {}

    async def run_forever(self) -> None:
        while True:
            active = sorted((s for s in self.store.batches() if s.batch.status in ACTIVE),
                            key=lambda s: s.batch.created_at)
            if not active:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=5.0)
                except TimeoutError:
                    pass
                continue
            try:
                await self.run(active[0].batch.id)
            except Exception:
                log.exception("batch %s failed to run; trying again shortly", active[0].batch.id)
                await asyncio.sleep(self.retry_pause_s)

    async def run(self, batch_id: str) -> None:
        """Run a batch's remaining lines, then finish it."""
        stored = self.store.stored_batch(batch_id)
        assert stored is not None
        lines = self.store.input_lines(stored.tenant.owner, stored.batch)
        done, completed, failed = self.store.done_lines(batch_id)
        self.progress = {batch_id: [completed, failed]}
        todo = [line for line in lines if line.line not in done]
        slots = asyncio.Semaphore(self.concurrency)
        tasks = []
        for line in todo:
            await slots.acquire()
            if self._stop_reason(batch_id) is not None:
                slots.release()
                break
            tasks.append(asyncio.create_task(self._one(stored, line, slots)))
        await asyncio.gather(*tasks)
        expired = bool(todo) and self._stop_reason(batch_id) == "expired"
        if expired:
            self._expire(stored, todo[len(tasks):])
        self._finish(batch_id, expired=expired)

    def _stop_reason(self, batch_id: str) -> str | None:
        """Why no more lines of the batch start ("cancelling", "expired"; None: they do), from
        its record (a cancel comes from another call)."""
        stored = self.store.stored_batch(batch_id)
        if stored is None or stored.batch.status == "cancelling":
            return "cancelling"
        return "expired" if time.time() > stored.batch.expires_at else None

    def _expire(self, stored: StoredBatch, unrun: list[LineRequest | LineProblem]) -> None:
        """The lines a batch past its window did not run: each an error, as OpenAI reports
        them (docs/protocols/batches.md)."""
        for line in unrun:
            self.store.append_result(stored.batch.id, "errors", line.line, line.custom_id, None,
                                     {"code": "batch_expired", "message": "This request could "
                                      "not be executed before the completion window expired."})
            self._count(stored.batch.id, failed=True)

    async def _one(self, stored: StoredBatch, line: LineRequest | LineProblem,
                   slots: asyncio.Semaphore) -> None:
        try:
            number = line.line
            if isinstance(line, LineProblem):
                self.store.append_result(stored.batch.id, "errors", number, line.custom_id, None,
                                         {"code": "invalid_request", "message": line.message,
                                          "line": number})
                self._count(stored.batch.id, failed=True)
                return
            status, body, request_id = await self._send(stored, line)
            response = {"status_code": status, "request_id": request_id, "body": body}
            kind = "output" if status < 300 else "errors"
            self.store.append_result(stored.batch.id, kind, number, line.custom_id, response,
                                     None)
            self._count(stored.batch.id, failed=kind == "errors")
        finally:
            slots.release()

    def _count(self, batch_id: str, failed: bool) -> None:
        counts = self.progress.get(batch_id)
        if counts is not None:
            counts[1 if failed else 0] += 1

    def counts(self, batch: BatchObject) -> BatchObject:
        """``batch`` with its request counts so far while it runs."""
        counts = self.progress.get(batch.id)
        if counts is None or batch.status not in ACTIVE:
            return batch
        return msgspec.structs.replace(batch, request_counts=RequestCounts(
            total=batch.request_counts.total, completed=counts[0], failed=counts[1]))

    async def _send(self, stored: StoredBatch, line: LineRequest) -> tuple[int, dict, str]:
        for attempt in range(ATTEMPTS):
            status, body, request_id = await self.send(stored.tenant, stored.batch.endpoint,
                                                       line.body)
            if status not in RETRY_STATUSES or attempt == ATTEMPTS - 1:
                return status, body, request_id
            await asyncio.sleep(self.retry_pause_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def _finish(self, batch_id: str, expired: bool) -> None:
        stored = self.store.stored_batch(batch_id)
        assert stored is not None
        batch, now = stored.batch, int(time.time())
        if batch.status != "finalizing":
            batch.status, batch.finalizing_at = "finalizing", now
            self.store.save(stored)
        completed, failed = self.progress[batch_id]  # run() read them, _one() counted
        batch.request_counts = RequestCounts(total=batch.request_counts.total,
                                             completed=completed, failed=failed)
        batch.output_file_id = self.store.publish_results(stored, "output")
        batch.error_file_id = self.store.publish_results(stored, "errors")
        if batch.cancelling_at is not None:
            batch.status, batch.cancelled_at = "cancelled", now
        elif expired:
            batch.status, batch.expired_at = "expired", now
        else:
            batch.status, batch.completed_at = "completed", now
        self.store.save(stored)


"""Where batches run (docs/protocols/batches.md, "Where batches live").

:class:`BatchHost` is the store and the runner in one process, sending lines through a gateway
app of its own (:func:`app_sender`). In a cluster it lives in one named, detached Ray actor on
the head node (the state directory's disk), apart from every ingress replica: an ingress that
dies takes no batch line with it. Ray restarts the actor if its process dies, and the runner
goes on from the results on disk. :class:`RayBatches` is an ingress replica's way to it,
:class:`LocalBatches` a process's own (tests); :class:`KeyScopedBatches` is what the routes see:
the calling key's files and batches only.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import httpx

from gateway.cluster.batches.runner import BatchRunner, Send
from gateway.cluster.batches.store import BatchStore, Tenant
from gateway.cluster.ledger import Limits
from gateway.cluster.state import NAMESPACE, named_actor
from gateway.ingress.meter import BATCH_TIER, KeyState, current_key
from protocols.openai.batch_objects import (
    BatchObject,
    BatchRefused,
    BatchRequest,
    FileObject,
)

__all__ = ["ACTOR_NAME", "NAMESPACE", "BatchHost", "KeyScopedBatches", "LocalBatches", "RayBatches",
           "app_sender"]

ACTOR_NAME = "llm-gateway-batches-v1"


def app_sender(app) -> Send:
    """Lines sent through ``app`` (a gateway app without keys, its engines metered) in this
    process, each as its batch owner's key at the batch tier."""
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batch",
                               timeout=None)

    async def send(tenant: Tenant, endpoint: str, body: dict) -> tuple[int, dict, str]:
        state = KeyState(owner=tenant.owner, name=tenant.name, tier=BATCH_TIER,
                         limits=Limits(token_budget=tenant.token_budget,
                                       budget_period=tenant.budget_period),
                         models=None if tenant.models is None else frozenset(tenant.models))
        token = current_key.set(state)  # the app runs in this task: it sees the key
        try:
            response = await client.post(endpoint, json=body)
        finally:
            current_key.reset(token)
        try:
            answer = response.json()
        except ValueError:
            answer = {"error": {"message": response.text[:1000], "type": "server_error"}}
        return response.status_code, answer, response.headers.get("x-request-id", "")

    return send


class BatchHost:
    """The store and the runner in this process; every call names the owner it is for."""

    def __init__(self, store: BatchStore, send: Send, concurrency: int = 8):
        self.store = store
        self.runner = BatchRunner(store, send, concurrency)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.runner.run_forever())

    def put_file(self, owner: str, filename: str, purpose: str, content: bytes) -> FileObject:
        return self.store.put_file(owner, filename, purpose, content)

    def file(self, owner: str, file_id: str) -> FileObject | None:
        return self.store.file(owner, file_id)

    def files(self, owner: str, purpose: str | None) -> list[FileObject]:
        return self.store.files(owner, purpose)

    def file_content(self, owner: str, file_id: str) -> bytes | None:
        return self.store.content(owner, file_id)

    def delete_file(self, owner: str, file_id: str) -> bool:
        return self.store.delete_file(owner, file_id)

    def create_batch(self, tenant: Tenant, request: BatchRequest) -> BatchObject:
        batch = self.store.create_batch(tenant, request)
        self.start()
        self.runner.wake.set()
        return batch

    def batch(self, owner: str, batch_id: str) -> BatchObject | None:
        self.start()  # a restarted host resumes its batches when anyone asks
        batch = self.store.batch(owner, batch_id)
        return None if batch is None else self.runner.counts(batch)

    def batches(self, owner: str) -> list[BatchObject]:
        return [self.runner.counts(s.batch) for s in self.store.batches(owner)]

    def cancel_batch(self, owner: str, batch_id: str) -> BatchObject | None:
        stored = self.store.stored_batch(batch_id)
        if stored is None or stored.tenant.owner != owner:
            return None
        batch = stored.batch
        if batch.status in ("cancelling", "cancelled"):
            return batch
        if batch.status not in ("validating", "in_progress"):
            raise BatchRefused(409, f"Cannot cancel a batch with status '{batch.status}'.")
        batch.status, batch.cancelling_at = "cancelling", int(time.time())
        self.store.save(stored)
        self.runner.wake.set()
        return batch


class LocalBatches:
    """A :class:`BatchHost` of this process behind the calls :class:`RayBatches` makes."""

    def __init__(self, host: BatchHost):
        self.host = host

    async def call(self, method: str, *args: Any) -> Any:
        return getattr(self.host, method)(*args)


@functools.cache
def _actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class BatchActor:
        def __init__(self, config: Any, app_name: str):
            from gateway.cluster.batches.build import cluster_host

            self.host = cluster_host(config, app_name)
            self.host.start()  # an actor Ray restarted goes on with its batches at once

        async def call(self, method: str, *args: Any) -> Any:
            return getattr(self.host, method)(*args)

    return BatchActor


class RayBatches:
    """The cluster's batch host through its actor (started by the first caller)."""

    def __init__(self, config: Any, app_name: str):
        self.config, self.app_name = config, app_name
        self._actor: Any = None
        self._lock = asyncio.Lock()

    async def call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError

        async with self._lock:
            if self._actor is None:
                # No retries: a batch made twice would run twice.
                self._actor = await named_actor(_actor_class(), ACTOR_NAME, self.config,
                                                self.app_name, max_task_retries=0)
            actor = self._actor
        try:
            return await actor.call.remote(method, *args)
        except RayActorError:
            self._actor = None
            raise BatchRefused(503, "The batch service is restarting; retry shortly.") from None


class KeyScopedBatches:
    """The :class:`~protocols.openai.batch_objects.BatchService` the routes use: the calling
    key's files and batches (without keys, every caller is the same one)."""

    def __init__(self, inner: LocalBatches | RayBatches):
        self.inner = inner

    @staticmethod
    def _owner() -> str:
        state = current_key.get()
        return state.owner if state is not None else ""

    @staticmethod
    def _tenant() -> Tenant:
        state = current_key.get()
        if state is None:
            return Tenant()
        return Tenant(owner=state.owner, name=state.name,
                      models=None if state.models is None else sorted(state.models),
                      token_budget=state.limits.token_budget,
                      budget_period=state.limits.budget_period)

    async def put_file(self, filename: str, purpose: str, content: bytes) -> FileObject:
        return await self.inner.call("put_file", self._owner(), filename, purpose, content)

    async def file(self, file_id: str) -> FileObject | None:
        return await self.inner.call("file", self._owner(), file_id)

    async def files(self, purpose: str | None) -> list[FileObject]:
        return await self.inner.call("files", self._owner(), purpose)

    async def file_content(self, file_id: str) -> bytes | None:
        return await self.inner.call("file_content", self._owner(), file_id)

    async def delete_file(self, file_id: str) -> bool:
        return await self.inner.call("delete_file", self._owner(), file_id)

    async def create_batch(self, request: BatchRequest) -> BatchObject:
        return await self.inner.call("create_batch", self._tenant(), request)

    async def batch(self, batch_id: str) -> BatchObject | None:
        return await self.inner.call("batch", self._owner(), batch_id)

    async def batches(self) -> list[BatchObject]:
        return await self.inner.call("batches", self._owner())

    async def cancel_batch(self, batch_id: str) -> BatchObject | None:
        return await self.inner.call("cancel_batch", self._owner(), batch_id)


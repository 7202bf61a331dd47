"""The Responses API's stored responses, shared by every replica of the cluster: one named,
detached Ray actor holding a bounded :class:`~protocols.responses.store.ResponseCache`
(docs/protocols/responses.md, "Stored responses").

A conversation's next request may reach another replica, another application (each model's own,
or the gateway's for ``GET /v1/responses/{id}``, which names no model), or the same after a
restart: so the cache lives in none of them. The first replica that stores or reads a response
starts the actor (``get_if_exists``); the others find it by name. It keeps its entries for the
cluster's life, across redeployments, within its byte bound; if it dies, they are gone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from protocols.responses.store import ResponseCache, StoredResponse

__all__ = ["ACTOR_NAME", "RayResponseStore"]

ACTOR_NAME = "llm-gateway-responses"
_NAMESPACE = "llm-gateway"


@ray.remote(num_cpus=0, max_restarts=-1)
class _ResponseStoreActor:
    def __init__(self, max_bytes: int):
        self.cache = ResponseCache(max_bytes)

    def get(self, response_id: str) -> StoredResponse | None:
        return self.cache.get(response_id)

    def put(self, stored: StoredResponse) -> bool:
        return self.cache.put(stored)

    def delete(self, response_id: str) -> bool:
        return self.cache.delete(response_id)


class RayResponseStore:
    """The cluster's stored responses, through the named actor (started at first use)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._actor: Any = None
        self._lock = asyncio.Lock()

    async def _store(self) -> Any:
        async with self._lock:
            if self._actor is None:
                # Blocking (a lookup, or the actor's start): off the replica's event loop.
                self._actor = await asyncio.to_thread(
                    _ResponseStoreActor.options(name=ACTOR_NAME, namespace=_NAMESPACE,
                                                lifetime="detached", get_if_exists=True).remote,
                    self.max_bytes)
            return self._actor

    async def get(self, response_id: str) -> StoredResponse | None:
        return await (await self._store()).get.remote(response_id)

    async def put(self, stored: StoredResponse) -> bool:
        return await (await self._store()).put.remote(stored)

    async def delete(self, response_id: str) -> bool:
        return await (await self._store()).delete.remote(response_id)

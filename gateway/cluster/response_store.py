"""The Responses API's stored responses, shared by every replica of the cluster: one named,
detached Ray actor holding a bounded :class:`~protocols.responses.store.ResponseCache`
(docs/protocols/responses.md, "Stored responses").

A conversation's next request may reach another replica, another application (each model's own,
or the gateway's for ``GET /v1/responses/{id}``, which names no model), or the same after a
restart: so the cache lives in none of them. The first replica that stores or reads a response
starts the actor (``get_if_exists``; its size is that replica's ``stored_responses_mib``); the
others find it by name. It keeps its entries for the cluster's life, across redeployments,
within its byte bound; if its process dies, Ray restarts it empty. Responses cross as encoded
bytes: the actor does no decoding, each replica its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray.exceptions import RayActorError

from protocols.responses.store import ResponseCache, StoredResponse, decode, encode

__all__ = ["ACTOR_NAME", "RayResponseStore"]

# The stored layout's version is in the name: a gateway that stores another one starts its own
# (v2: each response names its owner; a v1 replica would drop that and show it to every key).
ACTOR_NAME = "llm-gateway-responses-v2"
_NAMESPACE = "llm-gateway"


@ray.remote(num_cpus=0)
class _ResponseStoreActor:
    def __init__(self, max_bytes: int):
        self.cache = ResponseCache(max_bytes)

    def get(self, response_id: str) -> bytes | None:
        return self.cache.get(response_id)

    def put(self, response_id: str, raw: bytes) -> bool:
        return self.cache.put(response_id, raw)

    def delete(self, response_id: str) -> bool:
        return self.cache.delete(response_id)


class RayResponseStore:
    """The cluster's stored responses, through the named actor (started at first use)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._actor: Any = None
        self._lock = asyncio.Lock()

    async def _call(self, method: str, *args: Any) -> Any:
        async with self._lock:
            if self._actor is None:
                # A GCS lookup, or the actor's start, is blocking: off the replica's loop.
                self._actor = await asyncio.to_thread(
                    _ResponseStoreActor.options(
                        name=ACTOR_NAME, namespace=_NAMESPACE, lifetime="detached",
                        get_if_exists=True, max_restarts=-1, max_task_retries=3).remote,
                    self.max_bytes)
            actor = self._actor
        try:
            return await getattr(actor, method).remote(*args)
        except RayActorError:
            self._actor = None  # gone for good: the next call finds (or starts) it again
            raise

    async def get(self, response_id: str) -> StoredResponse | None:
        return decode(await self._call("get", response_id))

    async def put(self, stored: StoredResponse) -> bool:
        return await self._call("put", stored.response["id"], encode(stored))

    async def delete(self, response_id: str) -> bool:
        return await self._call("delete", response_id)

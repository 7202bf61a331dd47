"""Stored responses: what ``previous_response_id`` continues from and what ``GET``/``DELETE
/v1/responses/{id}`` read (docs/protocols/responses.md, "Stored responses").

:class:`ResponseCache` is the bounded store itself (least recently used dropped first, by the
bytes its entries encode to); :class:`MemoryStore` serves it in process (tests, one replica). The
gateway's replicas share one cache in a Ray actor (``gateway/cluster/response_store.py``), since a
conversation's next request may reach any replica of any layout.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

import msgspec

__all__ = ["MemoryStore", "ResponseCache", "ResponseStore", "StoredResponse", "decode",
           "encode"]


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True):
    """One response as answered (``response``), the input items its request sent, and
    ``context``: the items a response that continues it starts from (its own context, then its
    input, then its output; instructions are not carried over, as in OpenAI's API).
    ``owner``: who may read it back; the gateway fills it with its caller's key digest
    (``gateway.ingress.keys.KeyScopedStore``), empty when it checks no keys."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]]
    owner: str = ""


class ResponseStore(Protocol):
    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def put(self, stored: StoredResponse) -> bool:
        """False when it is not kept (larger than the whole store)."""
        ...

    async def delete(self, response_id: str) -> bool: ...


class ResponseCache:
    """At most ``max_bytes`` of responses, kept encoded (the bound is what they occupy, and
    they cross to and from an actor as bytes); the least recently used go first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> bytes | None:
        raw = self._entries.get(response_id)
        if raw is not None:
            self._entries.move_to_end(response_id)
        return raw

    def put(self, response_id: str, raw: bytes) -> bool:
        if len(raw) > self.max_bytes:
            return False
        self.delete(response_id)
        self._entries[response_id] = raw
        self.bytes += len(raw)
        while self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= len(dropped)
        return True

    def delete(self, response_id: str) -> bool:
        raw = self._entries.pop(response_id, None)
        if raw is None:
            return False
        self.bytes -= len(raw)
        return True


def encode(stored: StoredResponse) -> bytes:
    return msgspec.json.encode(stored)


def decode(raw: bytes | None) -> StoredResponse | None:
    return None if raw is None else msgspec.json.decode(raw, type=StoredResponse)


class MemoryStore:
    """A :class:`ResponseCache` in this process."""

    def __init__(self, max_bytes: int):
        self.cache = ResponseCache(max_bytes)

    async def get(self, response_id: str) -> StoredResponse | None:
        return decode(self.cache.get(response_id))

    async def put(self, stored: StoredResponse) -> bool:
        return self.cache.put(stored.response["id"], encode(stored))

    async def delete(self, response_id: str) -> bool:
        return self.cache.delete(response_id)

"""Where the ledger lives (docs/tenancy.md, "One ledger for the cluster").

:class:`LocalLedger` holds a :class:`~gateway.cluster.ledger.Ledger` in this process (a gateway
without Ray, unit tests). :class:`RayLedger` reaches the cluster's: one named, detached Ray actor
on the head node, started by the first process that needs it, which writes its usage, budgets
and admin keys to ``<state_directory>/ledger.json`` (at most once a second, atomically) and
reads them back when Ray restarts it. An ingress replica calls it once per request of a key with
limits (admission), and sends its usage in one call per quarter second; if the actor cannot be
reached within :data:`CALL_TIMEOUT_S` (:data:`START_TIMEOUT_S` while it starts), the replica
counts in a ledger of its own until it can (limits then hold per replica, as before tenancy),
and says so in its log.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from pathlib import Path
from typing import Any

from gateway.cluster.ledger import Charge, Grant, KeyRecord, Ledger, Limits, UsageRow
from gateway.cluster.state import named_actor, write_atomically

__all__ = ["ACTOR_NAME", "CALL_TIMEOUT_S", "LocalLedger", "RayLedger"]

log = logging.getLogger(__name__)

ACTOR_NAME = "llm-gateway-ledger-v1"
CALL_TIMEOUT_S = 2.0
START_TIMEOUT_S = 60.0
SAVE_EVERY_S = 1.0


class LocalLedger:
    """The ledger in this process, behind the same async calls as the cluster's."""

    def __init__(self, ledger: Ledger | None = None):
        self.ledger = ledger or Ledger()

    async def admit(self, key: str, limits: Limits, holder: str) -> Grant:
        return self.ledger.admit(key, limits, holder)

    async def release(self, key: str, slot: int) -> None:
        self.ledger.release(key, slot)

    async def renew(self, holder: str) -> None:
        self.ledger.renew(holder)

    async def charge(self, charges: list[Charge]) -> dict[str, int]:
        return self.ledger.charge(charges)

    async def usage(self, key: str | None, since: str, until: str) -> list[UsageRow]:
        return self.ledger.usage(key, since, until)

    async def keys(self) -> dict[str, KeyRecord]:
        return self.ledger.key_records()

    async def put_key(self, name: str, record: KeyRecord) -> None:
        self.ledger.put_key(name, record)

    async def delete_key(self, name: str) -> bool:
        return self.ledger.delete_key(name)


@functools.cache
def _ledger_actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class LedgerActor:
        """The cluster's ledger; every method under one lock (the saver thread reads it)."""

        def __init__(self, directory: str):
            self.path = Path(directory) / "ledger.json"
            self.ledger = Ledger()
            self.lock = threading.Lock()
            if self.path.exists():
                self.ledger.restore(self.path.read_bytes())
            threading.Thread(target=self._save_loop, daemon=True).start()

        def call(self, method: str, *args: Any) -> Any:
            with self.lock:
                return getattr(self.ledger, method)(*args)

        def save(self) -> None:
            with self.lock:
                if not self.ledger.changed:
                    return
                raw = self.ledger.snapshot()
            write_atomically(self.path, raw)

        def _save_loop(self) -> None:
            while True:
                threading.Event().wait(SAVE_EVERY_S)
                try:
                    self.save()
                except OSError:
                    log.exception("could not save the ledger to %s", self.path)

    return LedgerActor


class RayLedger:
    """The cluster's ledger through its actor (module docstring), with this process's own as
    the fallback while the actor cannot be reached."""

    def __init__(self, directory: str):
        self.directory = directory
        self.fallback = LocalLedger()
        self._actor: Any = None
        self._lock = asyncio.Lock()
        self._warned = False

    async def _handle(self) -> Any:
        """The actor, found or started, and ready: the first calls wait for its start (a
        process to launch: seconds), not only CALL_TIMEOUT_S, so they are counted by it."""
        async with self._lock:
            if self._actor is None:
                actor = await named_actor(_ledger_actor_class(), ACTOR_NAME, self.directory,
                                          max_task_retries=3)
                async with asyncio.timeout(START_TIMEOUT_S):
                    await actor.__ray_ready__.remote()
                self._actor = actor
            return self._actor

    async def _call(self, method: str, *args: Any, fallback: bool = True) -> Any:
        """``fallback``: answer from this process's ledger if the actor does not (limits and
        usage; an admin change must reach the cluster's or fail)."""
        from ray.exceptions import RayError

        try:
            actor = await self._handle()
            async with asyncio.timeout(CALL_TIMEOUT_S):
                result = await actor.call.remote(method, *args)
        except (RayError, TimeoutError):
            self._actor = None
            if not fallback:
                raise
            if not self._warned:
                log.warning("the cluster's ledger (%s) did not answer: counting limits in this "
                            "process until it does", ACTOR_NAME)
                self._warned = True
            return await getattr(self.fallback, method)(*args)
        self._warned = False
        return result

    async def admit(self, key: str, limits: Limits, holder: str) -> Grant:
        return await self._call("admit", key, limits, holder)

    async def release(self, key: str, slot: int) -> None:
        await self._call("release", key, slot)

    async def renew(self, holder: str) -> None:
        await self._call("renew", holder)

    async def charge(self, charges: list[Charge]) -> dict[str, int]:
        return await self._call("charge", charges)

    async def usage(self, key: str | None, since: str, until: str) -> list[UsageRow]:
        return await self._call("usage", key, since, until)

    async def keys(self) -> dict[str, KeyRecord]:
        return await self._call("key_records", fallback=False)

    async def put_key(self, name: str, record: KeyRecord) -> None:
        await self._call("put_key", name, record, fallback=False)

    async def delete_key(self, name: str) -> bool:
        return await self._call("delete_key", name, fallback=False)

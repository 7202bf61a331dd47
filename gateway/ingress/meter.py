"""One process's side of tenancy (docs/tenancy.md): admission through the ledger, usage sent in
batches, and each generation's priority from its key's tier and recent share of tokens.

:class:`TenantMeter` is made once per app; :class:`MeteredEngine` wraps each model's engine and
does, per generation, what needs the model: the key's allowed models, its priority, a refusal
while the ledger said the key is over its tokens per minute or budget, and the tokens charged
when the generation ends.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Protocol

import msgspec

from contract import ErrorEvent, Event, FinalEvent, GenerateRequest, TokenEvent
from contract.client import EngineClient
from gateway.cluster.ledger import Charge, Grant, KeyRecord, Limits, UsageRow
from gateway.ingress.registry import EngineWrapper
from gateway.ingress.telemetry import (
    MAX_KEY_LABELS,
    GatewayMetrics,
    bounded_label,
    current_record,
    refused_for,
)

__all__ = ["BATCH_TIER", "FLUSH_S", "KeyState", "LedgerPort", "MeteredEngine", "TenantMeter",
           "current_key", "priority_of"]

log = logging.getLogger(__name__)

FLUSH_S = 0.25  # usage reaches the ledger this often (the staleness of token limits)
RENEW_S = 5.0  # the holder's lease on its concurrency slots is renewed this often
HALF_LIFE_S = 30.0  # of a key's recent tokens, for fair share within a tier
BATCH_TIER = 9  # batches run below every key's tier
TIER_SPAN, OWN_SPAN = 1000, 100  # priority = tier * 1000 + own (0-9) * 100 + share rank (0-99)


class LedgerPort(Protocol):
    """The ledger's calls (``gateway.cluster.ledger_actor``: in process or the cluster's actor)."""

    async def admit(self, key: str, limits: Limits, holder: str) -> Grant: ...
    async def release(self, key: str, slot: int) -> None: ...
    async def renew(self, holder: str) -> None: ...
    async def charge(self, charges: list[Charge]) -> dict[str, tuple[int, str]]: ...
    async def usage(self, key: str | None, since: str, until: str) -> list[UsageRow]: ...
    async def keys(self) -> dict[str, KeyRecord]: ...
    async def put_key(self, name: str, record: KeyRecord) -> None: ...
    async def delete_key(self, name: str) -> bool: ...


class KeyState(msgspec.Struct, kw_only=True):
    """A caller: its key's id (``owner``, a digest), name, limits, models and tier."""

    owner: str
    name: str
    limits: Limits = Limits()
    models: frozenset[str] | None = None
    tier: int = 1

    def may_use(self, model: str, adapter: str | None) -> bool:
        return self.models is None or model in self.models or adapter in self.models


current_key: ContextVar[KeyState | None] = ContextVar("current_key", default=None)


def priority_of(tier: int, requested: int, rank: int) -> int:
    """The engine priority (lower runs first): the tier, then the request's own priority (0-9,
    MindIE's and vLLM's field), then the key's rank by recent tokens (fair share)."""
    return tier * TIER_SPAN + min(max(requested, 0), 9) * OWN_SPAN + min(max(rank, 0), 99)


class TenantMeter:
    """Per process: admission, usage in batches, blocked keys, fair share (module docstring)."""

    def __init__(self, ledger: LedgerPort, holder: str | None = None,
                 metrics: GatewayMetrics | None = None):
        self.ledger = ledger
        self.metrics = metrics
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._pending: dict[tuple[str, str, str], Charge] = {}
        # key id → (monotonic time it may generate again, why not before)
        self._blocked: dict[str, tuple[float, str]] = {}
        self._recent: dict[str, tuple[float, float]] = {}  # key id → (tokens, as of)
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None

    async def admit(self, state: KeyState) -> Grant | None:
        """The ledger's answer for a key with limits; None for a key without."""
        self._start()
        if not state.limits.any:
            return None
        return await self.ledger.admit(state.owner, state.limits, self.holder)

    def release(self, state: KeyState, grant: Grant | None) -> None:
        if grant is not None and grant.slot:
            self._spawn(self.ledger.release(state.owner, grant.slot))

    def blocked(self, state: KeyState) -> str | None:
        """Why ``state``'s key may not generate now, with when it may (None: it may)."""
        entry = self._blocked.get(state.owner)
        if entry is None:
            return None
        left = entry[0] - time.monotonic()
        if left <= 0:
            del self._blocked[state.owner]
            return None
        return f"{entry[1]}; retry in {max(1, math.ceil(left))} s"

    async def charge(self, state: KeyState, model: str, protocol: str, prompt: int,
                     completion: int, requests: int = 1) -> None:
        """Count a generation's tokens: at once for a key with token limits (its next request
        must see them), else with the next flush."""
        self.count(state, model, protocol, prompt, completion, requests)
        if state.limits.tokens_per_min is not None or state.limits.token_budget is not None:
            await self.flush()

    def count(self, state: KeyState, model: str, protocol: str, prompt: int,
              completion: int, requests: int) -> None:
        """Add a generation's tokens to the next flush (and to the key's series)."""
        self._start()
        self._record(state, model, protocol, prompt, completion, requests)
        self._add(Charge(
            key=state.owner, name=state.name, model=model, protocol=protocol, requests=requests,
            prompt_tokens=prompt, completion_tokens=completion,
            tokens_per_min=state.limits.tokens_per_min, token_budget=state.limits.token_budget,
            budget_period=state.limits.budget_period))
        tokens, stamp = self._recent.get(state.owner, (0.0, time.monotonic()))
        self._recent[state.owner] = (self._decayed(tokens, stamp) + prompt + completion,
                                     time.monotonic())

    def _record(self, state: KeyState, model: str, protocol: str, prompt: int,
                completion: int, requests: int) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        tags = {"key": bounded_label(metrics.key_labels, state.name, MAX_KEY_LABELS),
                "model": model, "protocol": protocol}
        if requests:
            metrics.key_requests.inc(requests, tags=tags)
        for kind, count in (("prompt", prompt), ("generated", completion)):
            if count:
                metrics.key_tokens.inc(count, tags={**tags, "kind": kind})

    def rank(self, state: KeyState) -> int:
        """The key's recent tokens on a log scale (0-99): a heavier user sorts later."""
        tokens, stamp = self._recent.get(state.owner, (0.0, time.monotonic()))
        return min(99, round(4 * math.log2(1 + self._decayed(tokens, stamp))))

    @staticmethod
    def _decayed(tokens: float, stamp: float) -> float:
        return tokens * 0.5 ** ((time.monotonic() - stamp) / HALF_LIFE_S)

    async def flush(self) -> None:
        """Send the usage counted here since the last flush (kept if the ledger fails)."""
        if not self._pending:
            return
        charges, self._pending = list(self._pending.values()), {}
        try:
            blocked = await self.ledger.charge(charges)
        except Exception:  # kept for the next flush, never lost to a hiccup
            log.warning("usage could not reach the ledger; kept for the next flush")
            for charge in charges:
                self._add(charge)
            return
        now = time.monotonic()
        for key, (wait_s, why) in blocked.items():
            self._blocked[key] = (now + wait_s, why)

    def _add(self, charge: Charge) -> None:
        """``charge`` into the next flush, summed with what is pending for its key, model and
        protocol (the limits stay the newest's)."""
        slot = (charge.key, charge.model, charge.protocol)
        pending = self._pending.get(slot)
        if pending is not None:
            charge = msgspec.structs.replace(
                charge, requests=charge.requests + pending.requests,
                prompt_tokens=charge.prompt_tokens + pending.prompt_tokens,
                completion_tokens=charge.completion_tokens + pending.completion_tokens)
        self._pending[slot] = charge

    def _start(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        renewed = 0.0
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()
            if time.monotonic() - renewed >= RENEW_S:
                renewed = time.monotonic()
                try:
                    await self.ledger.renew(self.holder)
                except Exception:  # the next renewal retries
                    log.warning("could not renew this process's lease with the ledger")

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class MeteredEngine(EngineWrapper):
    """A model's engine, its generations held to the calling key's policy (module docstring)."""

    def __init__(self, inner: EngineClient, *, model: str, meter: TenantMeter):
        super().__init__(inner)
        self.model = model
        self.meter = meter

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        state = current_key.get()
        if state is None:
            async for event in self.inner.generate(request):
                yield event
            return
        refusal = self._refusal(state, request)
        if refusal is not None:
            yield refusal
            return
        request = msgspec.structs.replace(request, priority=priority_of(
            state.tier, request.priority, self.meter.rank(state)))
        record = current_record()
        protocol = record.protocol if record is not None else "gateway"
        charged, unfinished = False, 0
        try:
            async for event in self.inner.generate(request):
                if isinstance(event, TokenEvent):
                    unfinished += 1
                elif isinstance(event, FinalEvent):
                    # Before the client has its answer, so its next request sees the tokens;
                    # the prompt (and the request) once, whatever the number of choices.
                    usage = event.usage
                    await self.meter.charge(state, self.model, protocol,
                                            0 if charged else usage.prompt_tokens,
                                            usage.completion_tokens, requests=0 if charged else 1)
                    charged, unfinished = True, 0
                yield event
        finally:
            if unfinished:  # a stream the client left: what it generated still counts
                self.meter.count(state, self.model, protocol, 0, unfinished,
                                 requests=0 if charged else 1)

    def _refusal(self, state: KeyState, request: GenerateRequest) -> ErrorEvent | None:
        adapter = request.adapter.name if request.adapter is not None else None
        if not state.may_use(self.model, adapter):
            # As OpenAI answers a model a project may not use: as if it did not exist.
            return ErrorEvent(kind="not_found", message=(
                f"The model `{adapter or self.model}` does not exist or this key may not use it."))
        why = self.meter.blocked(state)
        if why is not None:
            refused_for("rate_limit")
            return ErrorEvent(kind="rate_limited", message=why)
        return None

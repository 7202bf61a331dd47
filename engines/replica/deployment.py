"""The Ray Serve deployment that hosts one engine replica, of any engine kind.

Two ways for a generation's events to reach the ingress. By default (``generate_to``) the
ingress passes the address of its channel (``engines.channel``) and the events go there, every
stream's events of an engine step in one frame, while the Serve call only lasts as long as the
stream. With ``engine_transport: ray`` (``generate``) they are the call's streamed results:
msgpack-encoded *batches* of whatever the engine produced since the ingress last pulled, which
costs a Ray object per batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from ray import serve

from contract import (
    Adapter,
    EngineStats,
    Event,
    GenerateRequest,
    ModelInfo,
    Prompt,
    encode_events,
)
from contract.pump import Pump
from engines.caller.prefix_affinity import RecentPrompts
from engines.channel import ChannelAddress, ChannelSender
from engines.kit.base import ReferenceOutput
from engines.kit.config import ModelConfig
from engines.replica.callers import Caller, CallerWatch

__all__ = ["EngineDeployment", "EngineReplica", "drain_batches"]

# Events a generation may run ahead of the ingress pulling them (then the engine's own output
# collector merges its steps, as for any slow client).
_AHEAD_EVENTS = 4096


async def drain_batches(events: AsyncIterator[Event],
                        watch: Callable[[asyncio.Task], None] | None = None,
                        ) -> AsyncIterator[list[Event]]:
    """Re-chunk an event stream into lists of everything available when the consumer asks.

    A producer task runs ahead of the consumer (at most ``_AHEAD_EVENTS``); cancelling or
    closing this generator cancels it, which aborts the engine request. ``watch`` gets the
    producer task: cancelling it (its caller is gone) aborts the engine request too and ends
    this stream early, without an error.
    """
    async with Pump[Event](_AHEAD_EVENTS) as pump:
        producer = pump.start(events)
        if watch is not None:
            watch(producer)
        async for batch in pump.batches():
            yield batch


class EngineReplica:
    """Ray Serve replica: the engine contract over the model's engine kind, with events packed
    as msgpack batches (``gateway.ingress.engine_client.ServeEngineClient`` is the other end). A
    model's own application (``gateway.model_replica.ingress``) extends it with the protocols' HTTP routes
    over the same engine."""

    def __init__(self, config: ModelConfig):
        from engines.replica.host import EngineHost
        from engines.replica.serve_logs import keeping_serve_logs, log_with_serve

        log_with_serve()  # the engine's start (its placement step) in this replica's log
        with keeping_serve_logs():
            self.host = EngineHost.for_model(config)
        self.callers = CallerWatch()
        self.channels = ChannelSender()
        # What this replica was sent, for the routers of a model routed by prefix (the
        # prompt's hashing costs nothing elsewhere).
        self.recent_prompts = RecentPrompts() if config.routes_by_prefix() else None

    def note_request(self, request: GenerateRequest) -> None:
        """A generation starts here: recorded for prefix routing (docs/routing.md)."""
        if self.recent_prompts is not None:
            self.recent_prompts.note(request)

    def record_routing_stats(self) -> dict[str, list[int]]:
        """Serve's controller collects this for the model's routers (``engines.caller.prefix_router``)."""
        from engines.caller.routing import ROUTING_STATS_KEY

        keys = self.recent_prompts.keys() if self.recent_prompts is not None else []
        return {ROUTING_STATS_KEY: keys}

    async def generate(self, request: GenerateRequest,
                       caller: Caller | None = None) -> AsyncIterator[bytes]:
        """``caller``: the calling ingress replica's actor, whose death aborts the request
        (``engines.replica.callers``)."""
        self.note_request(request)
        watch = None if caller is None else (lambda task: self.callers.track(caller, task))
        async for batch in drain_batches(self.host.generate(request), watch):
            yield encode_events(batch)

    async def generate_to(self, request: GenerateRequest, channel: ChannelAddress,
                          caller: Caller | None = None) -> int:
        """Stream the generation's events over the ingress's channel (``engines.channel``)
        rather than as this call's results; returns when the stream is over, with the number
        of events sent."""
        self.note_request(request)
        if caller is not None:
            self.callers.track(caller, asyncio.current_task())
        return await self.channels.stream(channel, self.host.generate(request))

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        return await self.host.tokenize(prompt)

    async def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return await self.host.detokenize(token_ids)

    async def detokenize_each(self, token_ids: tuple[int, ...]) -> tuple[str, ...]:
        return await self.host.detokenize_each(token_ids)

    async def model_info(self) -> ModelInfo:
        return await self.host.model_info()

    async def stats(self) -> EngineStats:
        return await self.host.stats()

    async def check_health(self) -> None:
        await self.host.check_health()

    async def reference_greedy(self, prompt: str | list[int], max_tokens: int,
                               adapter: Adapter | None = None) -> ReferenceOutput:
        """The engine kind's own greedy decoding, bypassing the gateway (parity tests' oracle);
        ``adapter``: with that LoRA adapter."""
        return await self.host.reference_greedy(prompt, max_tokens, adapter)


EngineDeployment = serve.deployment(health_check_period_s=10,
                                    health_check_timeout_s=60)(EngineReplica)

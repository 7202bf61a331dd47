"""The engine contract over a Ray Serve deployment handle (used inside the ingress).

Besides translating calls, this is where the gateway stays honest when a replica is not:

- **No Ray detail reaches a client.** Ray's exceptions carry pids, IPs, actor ids and remote
  tracebacks; they are logged here with the request id and replaced by a short message.
- **Fast 503 while a model has no healthy replica.** A Serve handle queues a request until some
  replica takes it, which after a replica death means until Serve has restarted it (minutes for
  vLLM). After a replica failure, or a health check that went unanswered, new requests first
  wait at most ``probe_timeout_s`` for a health check and are refused as ``unavailable`` if it
  does not come back; one probe is shared by every request arriving meanwhile.
- **A watchdog** ends a stream whose engine has sent nothing for ``stall_timeout_s`` (a replica
  that is alive but stuck).

The pending bound and the default deadline are the process's, around every engine client alike
(``gateway.ingress.bounds``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from ray.serve.handle import DeploymentHandle

from contract import (
    EngineStats,
    EngineUnavailable,
    ErrorEvent,
    Event,
    FinalEvent,
    GenerateRequest,
    InvalidPrompt,
    ModelInfo,
    Prompt,
    decode_events,
)
from engines.channel import ChannelLost, ChannelReceiver, ChannelUnreachable
from engines.replica.callers import Caller, current_caller
from gateway.ingress.bounds import overloaded
from gateway.ingress.replica_monitor import IDLE_INTERVAL_S, INTERVAL_S, ReplicaMonitor
from gateway.ingress.serve_status import SERVE_STATUS
from gateway.ingress.telemetry import GatewayMetrics, gateway_metrics

__all__ = ["ServeEngineClient"]

log = logging.getLogger(__name__)

# The replica is gone or not (yet) there: the model is unavailable, not the request wrong.
_REPLICA_GONE = (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError, ChannelLost)


class ServeEngineClient:
    """:class:`contract.EngineClient` backed by an ``EngineDeployment`` handle."""

    def __init__(self, handle: DeploymentHandle, model: str | None = None, *,
                 stall_timeout_s: float | None = None, probe_timeout_s: float = 2.0,
                 monitor_interval_s: float | None = INTERVAL_S,
                 idle_monitor_interval_s: float = IDLE_INTERVAL_S,
                 channel: ChannelReceiver | None = None, caller: Caller | None = None,
                 metrics: GatewayMetrics | None = None):
        """``caller``: the named actor this client runs in, where it is not a Serve replica
        (the batch host): the engine replica aborts its generations if it dies."""
        self._handle = handle
        self._channel = channel  # None: the events come as the Serve call's results
        self._streaming = handle.options(stream=True)
        self._metrics = metrics or gateway_metrics()
        self.model = model or handle.deployment_name
        self.stall_timeout_s = stall_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self._suspect = False  # a replica failed or a probe went unanswered
        self._probe: asyncio.Future[bool] | None = None
        self._probe_done_at = 0.0
        self._suspect_event: asyncio.Event | None = None
        self._monitor = ReplicaMonitor(self._running_replicas, self._mark_suspect,
                                       interval_s=monitor_interval_s,
                                       idle_interval_s=idle_monitor_interval_s)
        # This process as a caller: given, or its Serve replica's name once known.
        self._caller: Caller | bool | None = caller if caller is not None else False

    # --- availability ---------------------------------------------------------------------

    def _no_replica(self) -> EngineUnavailable:
        return EngineUnavailable(self.model, "no healthy engine replica")

    def _mark_suspect(self) -> None:
        self._suspect = True
        self._suspected().set()  # wakes requests still waiting for a replica (_assigned)

    def _suspected(self) -> asyncio.Event:
        if self._suspect_event is None:  # made on the ingress's loop, at first use
            self._suspect_event = asyncio.Event()
        return self._suspect_event

    async def available(self) -> bool:
        """Whether new requests should be sent (cheap unless a replica failed recently)."""
        self._monitor.ensure_running()
        if not self._suspect:
            return True
        recent = time.monotonic() - self._probe_done_at < self.probe_timeout_s
        if self._probe is None or (self._probe.done() and not recent):
            self._probe = asyncio.ensure_future(self._probe_once())
        return await asyncio.shield(self._probe)

    async def _probe_once(self) -> bool:
        try:
            await asyncio.wait_for(self._handle.check_health.remote(), self.probe_timeout_s)
        except BackPressureError:  # the queue in front of live replicas is full: busy, not gone
            pass
        except Exception:  # dead, restarting, or too busy to answer: all mean "not now"
            self._mark_suspect()
            return False
        finally:
            self._probe_done_at = time.monotonic()
        self._suspect = False
        self._suspected().clear()
        return True

    def _running_replicas(self) -> int:
        return SERVE_STATUS.running_replicas(self._handle.app_name, self._handle.deployment_name,
                                             fresh_s=self._monitor.interval_s / 2)

    # --- the contract ---------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self._monitor.note_request()
        if not await self.available():
            yield self._no_replica().event()
            return
        if self._caller is False:
            self._caller = current_caller()
        # Named, the engine replica aborts this generation if this ingress replica dies.
        extra = {} if self._caller is None else {"caller": self._caller}
        # A replica that died before sending anything is retried once: nothing reached the
        # client, and Serve's router, having seen the death, picks another replica (with two
        # replicas a killed one costs no failed new request).
        for attempt in (0, 1):
            received = ended = False
            try:
                async with aclosing(self._stream(request, extra)) as events:
                    async for event in events:
                        received = True
                        ended = ended or isinstance(event, FinalEvent | ErrorEvent)
                        yield event
                self._monitor.heard_at = time.monotonic()
                if not ended:  # the replica's side stopped (cancelled): never a silent success
                    log.warning("engine stream of %s ended before its end", request.request_id)
                    yield ErrorEvent(kind="engine", message="the engine ended the stream early")
                return
            except _NoReplica:
                yield self._no_replica().event()
                return
            except TimeoutError:
                log.error("engine for %s sent nothing for %g s; ending %s", self.model,
                          self.stall_timeout_s, request.request_id)
                self._mark_suspect()
                yield ErrorEvent(kind="engine", message=(
                    f"the engine stopped responding (nothing for {self.stall_timeout_s:g} s)"))
                return
            except ChannelUnreachable as exc:
                log.warning("engine replica of %s cannot reach this ingress's channel (%s): "
                            "streaming over Ray from now on", self.model, exc)
                self._channel = None
                if attempt == 0:
                    continue
                yield self._failure(request.request_id, exc)
                return
            except Exception as exc:  # replica died, queue full, ...: end the stream cleanly
                if attempt == 0 and not received and isinstance(exc, _REPLICA_GONE):
                    log.warning("engine replica for %s gone before %s started (%r)",
                                self.model, request.request_id, exc)
                    # Retry only where a health check says a replica is there; otherwise the
                    # retry would wait in Serve's router for as long as the restart takes.
                    self._mark_suspect()
                    if await self.available():
                        continue
                    yield self._no_replica().event()
                    return
                yield self._failure(request.request_id, exc)
                return

    def _stream(self, request: GenerateRequest, extra: dict) -> AsyncIterator[Event]:
        transport = "ray" if self._channel is None else "channel"
        self._metrics.engine_streams.inc(tags={"model": self.model, "transport": transport})
        if self._channel is not None:
            return self._stream_over_channel(request, extra)
        return self._stream_over_ray(request, extra)

    async def _stream_over_ray(self, request: GenerateRequest, extra: dict,
                               ) -> AsyncIterator[Event]:
        """The generation's events as the Serve call's streamed results (msgpack batches)."""
        response = self._streaming.generate.remote(request, **extra)
        finished = False
        try:
            if not await self._assigned(response):
                raise _NoReplica
            async for blob in _within(aiter(response), self.stall_timeout_s):
                for event in decode_events(blob):
                    yield event
            finished = True
        finally:
            if not finished:  # failed, or the client went away: cancelling aborts the request
                response.cancel()

    async def _stream_over_channel(self, request: GenerateRequest, extra: dict,
                                   ) -> AsyncIterator[Event]:
        """The generation's events over this ingress's channel (``engines.channel``); the
        Serve call returns when the stream is over, and its failure ends the stream."""
        inbox = await self._channel.open(self.stall_timeout_s)
        response = self._handle.generate_to.remote(request, inbox.address, **extra)
        finished = False
        try:
            if not await self._assigned(response):
                raise _NoReplica
            call = asyncio.ensure_future(_answer(response))
            call.add_done_callback(inbox.call_finished)
            async for batch in inbox:  # TimeoutError: stalled (the inbox's own watchdog)
                for event in batch:
                    yield event
            finished = True
        finally:
            inbox.close()
            if not finished:
                response.cancel()

    async def _assigned(self, response) -> bool:
        """Wait until Serve's router has handed the request to a replica; False (the request
        withdrawn) if, meanwhile, the model turns out to have no healthy replica. Waiting for
        assignment is legitimate under load (the queue max_queued_requests bounds), but not
        while the router has no replica at all: it would wait for the whole restart."""
        fetch = getattr(response, "_fetch_future_result_async", None)  # Serve's, not public
        if fetch is None:
            return True
        assignment = asyncio.ensure_future(fetch())
        while True:
            suspected = asyncio.ensure_future(self._suspected().wait())
            try:
                await asyncio.wait({assignment, suspected}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                suspected.cancel()
            if assignment.done():
                assignment.result()  # a routing failure raises here, as iteration would
                return True
            if not await self.available():
                assignment.cancel()
                return False

    def _failure(self, request_id: str, exc: Exception) -> ErrorEvent:
        if isinstance(exc, BackPressureError):
            return overloaded(self.model)
        log.warning("engine call %s for %s failed: %r", request_id, self.model, exc)
        if isinstance(exc, _REPLICA_GONE):
            self._mark_suspect()
            return EngineUnavailable(self.model, "the engine replica failed").event()
        return ErrorEvent(kind="engine", message=f"engine call failed (request {request_id})")

    async def _call(self, what: str, method: str, *args: object) -> Any:
        if method != "check_health":
            self._monitor.note_request()
        if not await self.available():
            raise self._no_replica()
        try:
            return await getattr(self._handle, method).remote(*args)
        except InvalidPrompt as exc:  # Ray raises a RayTaskError that is also an InvalidPrompt
            raise InvalidPrompt(str(getattr(exc, "cause", exc))) from None
        except BackPressureError:
            if method == "check_health":  # refused by a full queue: busy, not unhealthy
                return None
            raise EngineUnavailable(self.model, f"{what} refused: the model is busy") from None
        except Exception as exc:
            log.warning("%s on %s failed: %r", what, self.model, exc)
            if isinstance(exc, _REPLICA_GONE):
                self._mark_suspect()
            raise EngineUnavailable(self.model, f"{what} failed") from None

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        return await self._call("tokenize", "tokenize", prompt)

    async def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return await self._call("detokenize", "detokenize", token_ids)

    async def detokenize_each(self, token_ids: tuple[int, ...]) -> tuple[str, ...]:
        return await self._call("detokenize", "detokenize_each", token_ids)

    async def model_info(self) -> ModelInfo:
        return await self._call("model info", "model_info")

    async def check_health(self) -> None:
        """Healthy while Serve has a running replica that passes its own health checks.

        Asked of Serve's controller, which health-checks each replica outside the request
        queue: a health call through the handle would wait behind a busy model's queue, or be
        refused by it, and a probe would pull the gateway exactly when it is saturated.
        The monitor's last reading is used (at most ``monitor_interval_s`` old, or
        ``idle_monitor_interval_s`` where no request came for a while), so probes cost no call
        of their own.
        """
        if not await self.available():  # also starts the monitor
            raise self._no_replica()
        if self._monitor.running is None:  # no reading yet, or no Serve controller here
            await self._call("health check", "check_health")
        elif self._monitor.running == 0:
            raise self._no_replica()

    async def stats(self) -> EngineStats:
        return await self._call("stats", "stats")


class _NoReplica(Exception):
    """The model turned out to have no healthy replica while the request waited for one."""


async def _answer(response) -> Any:
    return await response


async def _within(items: AsyncIterator, timeout_s: float | None) -> AsyncIterator:
    """``items``, each within ``timeout_s`` of the last (TimeoutError: the engine is stuck)."""
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                item = await anext(items)
        except StopAsyncIteration:
            return
        yield item

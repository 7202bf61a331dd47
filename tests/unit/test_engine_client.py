"""The ingress's engine client over a stand-in Serve handle: what a client sees when the replica
is full, dead, restarting or stuck, and that Ray's exception text never reaches it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from contract import (
    EngineUnavailable,
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    TextPrompt,
    TokenEvent,
    Usage,
    encode_events,
)
from engines.channel import ChannelReceiver, ChannelSender, ChannelUnreachable
from gateway.ingress.bounds import BoundedEngine
from gateway.ingress.engine_client import ServeEngineClient

SECRET = "Traceback ... pid=4242 ip=10.0.0.7 actor_id=abc123"


class _Died(ActorDiedError):
    """Ray's error as it arrives: its text names processes, addresses and actors."""

    def __str__(self) -> str:
        return SECRET


TOKEN = TokenEvent(index=0, token_id=7, text="x")
FINAL = FinalEvent(index=0, finish_reason="length", usage=Usage(prompt_tokens=1,
                                                                 completion_tokens=1))


class _Response:
    def __init__(self, blobs, error=None, hang=False):
        self.blobs, self.error, self.hang = list(blobs), error, hang
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.blobs:
            return self.blobs.pop(0)
        if self.error is not None:
            raise self.error
        if self.hang:
            await asyncio.Event().wait()
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _Handle:
    """What ServeEngineClient uses of a DeploymentHandle."""

    deployment_name = "engine-m"
    app_name = "default"

    def __init__(self):
        self.responses: list[_Response] = []
        self.sent: list[GenerateRequest] = []
        self.health: str = "ok"  # ok | hang | fail
        self.health_calls = 0
        self.generate = _Method(self._generate)
        self.check_health = _Method(self._check_health)
        self.model_info = _Method(self._model_info)

    def options(self, stream=False):
        return self

    def _generate(self, request):
        self.sent.append(request)
        return self.responses.pop(0)

    async def _check_health(self):
        self.health_calls += 1
        if self.health == "hang":
            await asyncio.Event().wait()
        if self.health == "fail":
            raise _Died()

    async def _model_info(self):
        raise RuntimeError(SECRET)


def _request(timeout_s=None):
    return GenerateRequest(request_id="r1", model="m", prompt=TextPrompt(text="hi"),
                           timeout_s=timeout_s)


def _client(handle, **kwargs):
    kwargs.setdefault("probe_timeout_s", 0.2)
    return ServeEngineClient(handle, "m", monitor_interval_s=None, **kwargs)


async def _events(client, request=None):
    return [e async for e in client.generate(request or _request())]


async def test_a_full_queue_is_overloaded_without_ray_text():
    handle = _Handle()
    handle.responses.append(_Response([], error=BackPressureError(num_queued_requests=3,
                                                                  max_queued_requests=3)))
    [event] = await _events(_client(handle))
    assert event.kind == "overloaded" and "retry later" in event.message
    assert "BackPressure" not in event.message and "3" not in event.message


class _Clock:
    """The client's monotonic clock, moved only by the test: the probe window is then a fact
    of the test, not of how loaded the box running it is."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


async def test_a_dead_replica_makes_new_requests_fail_fast_until_it_is_back(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("gateway.ingress.engine_client.time", clock)
    handle = _Handle()
    handle.responses.append(_Response([encode_events([TOKEN])], error=_Died()))
    client = _client(handle)
    events = await _events(client)  # the in-flight stream ends with an error, not silently
    assert events[0] == TOKEN and events[-1].kind == "unavailable"
    assert SECRET not in events[-1].message and "pid" not in events[-1].message

    handle.health = "hang"  # Serve is restarting it: a health call would just queue
    # The health call never returns: being answered at all means the probe's timeout refused it
    # (the guard only turns a regression into a failure instead of a hung test).
    [event] = await asyncio.wait_for(_events(client), 30)
    assert event.kind == "unavailable" and handle.health_calls == 1
    for _ in range(20):  # requests arriving within the probe window share the failed probe
        clock.now += client.probe_timeout_s / 40
        [event] = await _events(client)
        assert event.kind == "unavailable"
    assert handle.health_calls == 1 and len(handle.sent) == 1  # nothing sent to the engine

    handle.health = "ok"
    clock.now += client.probe_timeout_s  # past the probe window: the next request probes again
    handle.responses.append(_Response([encode_events([TOKEN, FINAL])]))
    assert await _events(client) == [TOKEN, FINAL]
    assert handle.health_calls == 2
    handle.responses.append(_Response([encode_events([TOKEN, FINAL])]))
    assert await _events(client) == [TOKEN, FINAL]
    assert handle.health_calls == 2  # healthy again: no probe per request


async def test_a_stuck_replica_ends_the_stream_and_aborts_the_call():
    handle = _Handle()
    response = _Response([encode_events([TOKEN])], hang=True)
    handle.responses.append(response)
    events = await _events(_client(handle, stall_timeout_s=0.2))
    assert events[0] == TOKEN and isinstance(events[-1], ErrorEvent)
    assert events[-1].kind == "engine" and "stopped responding" in events[-1].message
    assert response.cancelled


async def test_a_stream_the_replica_ends_early_is_an_engine_error_not_a_success():
    handle = _Handle()  # the replica's side was cancelled: its stream just stops
    handle.responses.append(_Response([encode_events([TOKEN])]))
    events = await _events(_client(handle))
    assert events[0] == TOKEN and isinstance(events[-1], ErrorEvent)
    assert events[-1].kind == "engine" and "early" in events[-1].message
    handle.responses.append(_Response([encode_events([TOKEN, FINAL])]))
    assert await _events(_client(handle)) == [TOKEN, FINAL]


async def test_the_default_deadline_applies_only_where_the_protocol_set_none():
    handle = _Handle()
    client = BoundedEngine(_client(handle), "m", request_timeout_s=30.0)
    for timeout in (None, 5.0):
        handle.responses.append(_Response([encode_events([FINAL])]))
        await _events(client, _request(timeout))
    assert [r.timeout_s for r in handle.sent] == [30.0, 5.0]


async def test_other_calls_fail_as_unavailable_without_the_exception_text():
    client = _client(_Handle())
    with pytest.raises(EngineUnavailable) as caught:
        await client.model_info()
    assert SECRET not in str(caught.value) and "model info failed" in str(caught.value)


async def test_a_replica_that_died_before_streaming_is_retried_once():
    handle = _Handle()
    handle.responses += [_Response([], error=_Died()), _Response([encode_events([TOKEN, FINAL])])]
    client = _client(handle)
    assert await _events(client) == [TOKEN, FINAL]  # the second replica answered
    assert [r.request_id for r in handle.sent] == ["r1", "r1"]
    handle.responses += [_Response([], error=_Died()), _Response([], error=_Died())]
    [event] = await _events(client)  # both gone: one retry only, then unavailable
    assert event.kind == "unavailable" and len(handle.sent) == 4


class _Unrouted(_Response):
    """A request Serve's router holds because no replica is there to take it."""

    async def _fetch_future_result_async(self):
        await asyncio.Event().wait()


async def test_a_request_waiting_for_a_replica_is_withdrawn_when_none_is_healthy():
    handle = _Handle()
    handle.health = "hang"
    response = _Unrouted([])
    handle.responses.append(response)
    client = _client(handle)
    asyncio.get_running_loop().call_later(0.1, client._mark_suspect)  # as the monitor does
    # Both the router and the health call wait forever: an answer at all means it was withdrawn.
    [event] = await asyncio.wait_for(_events(client), 30)
    assert event.kind == "unavailable"
    assert response.cancelled


async def test_a_busy_model_is_healthy():
    """A full queue refuses the health call too (Serve's back-pressure): busy, not gone."""
    handle = _Handle()

    async def full():
        raise BackPressureError(num_queued_requests=8, max_queued_requests=8)

    handle.check_health = _Method(full)
    client = _client(handle)
    await client.check_health()  # no Serve controller here: the handle answers
    client._mark_suspect()
    assert await client.available()


async def test_past_its_pending_bound_a_model_refuses_without_calling_serve():
    handle = _Handle()
    handle.responses.append(_Response([encode_events([TOKEN])], hang=True))
    client = BoundedEngine(_client(handle), "m", max_pending=1)
    first = client.generate(_request())
    assert await anext(first) == TOKEN  # one generation in flight
    [event] = await _events(client)
    assert event.kind == "overloaded" and len(handle.sent) == 1  # refused before Serve
    await first.aclose()
    assert client.pending == 0
    handle.responses.append(_Response([encode_events([TOKEN, FINAL])]))
    assert await _events(client) == [TOKEN, FINAL]


# --- the same over the engine channel (engines.channel): real sockets, a stand-in Serve call ---

class _Call:
    """A unary Serve call as the ingress sees it: awaitable, cancellable."""

    def __init__(self, coroutine):
        self.task = asyncio.ensure_future(coroutine)
        self.cancelled = False

    def __await__(self):
        return self.task.__await__()

    def cancel(self):
        self.cancelled = True
        self.task.cancel()


class _ChannelHandle(_Handle):
    """An engine replica that streams over the channel: each call follows the next plan."""

    def __init__(self):
        super().__init__()
        self.sender = ChannelSender()
        self.plans: list = []
        self.calls: list[_Call] = []
        self.generate_to = _Method(self._generate_to)

    def _generate_to(self, request, address):
        self.sent.append(request)
        self.calls.append(_Call(self.plans.pop(0)(self.sender, address)))
        return self.calls[-1]


def _streams(events, then=None, hang=False, closed=None):
    async def generation():
        try:
            for event in events:
                yield event
            if hang:
                await asyncio.Event().wait()
        finally:
            if closed is not None:
                closed.append(True)

    async def plan(sender, address):
        sent = await sender.stream(address, generation())
        if then is not None:
            await asyncio.sleep(0.05)
            raise then
        return sent
    return plan


def _fails(exc):
    async def plan(sender, address):
        raise exc
    return plan


@pytest.fixture
async def channel_client():
    receiver, handle = ChannelReceiver(), _ChannelHandle()
    yield _client(handle, channel=receiver, stall_timeout_s=2.0), handle
    handle.sender.close()
    await receiver.close()


async def test_over_the_channel_a_stream_arrives_whole(channel_client):
    client, handle = channel_client
    handle.plans.append(_streams([TOKEN, TOKEN, FINAL]))
    assert await _events(client) == [TOKEN, TOKEN, FINAL]
    assert await handle.calls[0] == 3  # the call returns the count the engine sent


async def test_over_the_channel_a_replica_dead_before_streaming_is_retried_once(channel_client):
    client, handle = channel_client
    handle.plans += [_fails(_Died()), _streams([TOKEN, FINAL])]
    assert await _events(client) == [TOKEN, FINAL] and len(handle.sent) == 2


async def test_over_the_channel_a_replica_dying_mid_stream_ends_it_unavailable(channel_client):
    client, handle = channel_client
    handle.plans.append(_streams([TOKEN], hang=True))
    stream = client.generate(_request())
    assert await anext(stream) == TOKEN
    handle.calls[0].task.cancel()  # the call fails as a dead replica's does
    handle.calls[0].task = asyncio.ensure_future(_fails(_Died())(None, None))
    handle.sender.close()  # and its connection closes
    rest = [event async for event in stream]
    assert [e.kind for e in rest] == ["unavailable"] and SECRET not in rest[0].message


async def test_over_the_channel_a_client_that_leaves_aborts_the_engine_request(channel_client):
    client, handle = channel_client
    closed: list = []
    handle.plans.append(_streams([TOKEN], hang=True, closed=closed))
    stream = client.generate(_request())
    assert await anext(stream) == TOKEN
    await stream.aclose()
    assert handle.calls[0].cancelled
    await asyncio.wait_for(asyncio.wait([handle.calls[0].task]), 5)
    assert closed == [True]


async def test_over_the_channel_a_stuck_replica_ends_the_stream(channel_client):
    client, handle = channel_client
    # Long enough for the first token to cross a real socket on a loaded CI box (0.2 s was not).
    client.stall_timeout_s = 1.0
    handle.plans.append(_streams([TOKEN], hang=True))
    events = await _events(client)
    assert events[0] == TOKEN and "stopped responding" in events[-1].message
    assert handle.calls[0].cancelled


async def test_an_engine_that_cannot_reach_the_channel_falls_back_to_ray(channel_client):
    client, handle = channel_client
    handle.plans.append(_fails(ChannelUnreachable("10.0.0.7:4242 refused")))
    handle.responses += [_Response([encode_events([TOKEN, FINAL])]),
                         _Response([encode_events([FINAL])])]
    assert await _events(client) == [TOKEN, FINAL]
    assert await _events(client) == [FINAL]  # and from then on
    assert len(handle.calls) == 1 and len(handle.sent) == 3


async def test_the_monitor_asks_serve_only_while_no_stream_delivers(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from gateway.ingress.serve_status import SERVE_STATUS

    # A status thread of its own: the process's one may still be busy with a call an earlier
    # test's client left behind (after the e2e modules this test once waited 10 s for it).
    monkeypatch.setattr(SERVE_STATUS, "thread", ThreadPoolExecutor(1))
    handle, asked = _Handle(), []

    class _Monitored(ServeEngineClient):
        def _running_replicas(self) -> int:  # what serve.status() would say
            asked.append(time.monotonic())
            return 1

    # The loop's default executor full of stuck work (as after the e2e suites in one session):
    # the monitor has its own thread.
    release = threading.Event()
    stuck = [asyncio.get_running_loop().run_in_executor(None, release.wait) for _ in range(64)]
    try:
        await _monitor_asks_only_while_idle(handle, asked, _Monitored)
    finally:
        release.set()
        await asyncio.gather(*stuck)


async def _monitor_asks_only_while_idle(handle, asked, monitored) -> None:
    client = monitored(handle, "m", monitor_interval_s=0.3)
    assert await client.available()  # starts the monitor

    async def first_question() -> None:
        while not asked:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(first_question(), 10)
    # Streams completing back to back: Serve is not asked (one tick may see the last reading
    # old if this loop is starved on a loaded box).
    start = time.monotonic()
    while time.monotonic() - start < 1.5:
        handle.responses.append(_Response([encode_events([FINAL])]))
        assert await _events(client) == [FINAL]
        await asyncio.sleep(0.01)
    busy = len(asked) - 1
    assert busy <= 1, asked

    async def asked_twice_more() -> None:  # idle: asked again, tick after tick
        while len(asked) - 1 - busy < 2:
            await asyncio.sleep(0.01)

    # Bounded by time only as a hang guard: on a loaded CI box a tick took 1 s, not 0.3.
    await asyncio.wait_for(asked_twice_more(), 10)
    client._monitor.task.cancel()


async def test_an_idle_monitor_waits_for_a_request_and_then_asks_at_once(monkeypatch):
    """Where no request for the model came for a while (in the default layout the gateway
    application's ingress carries no OpenAI stream), the monitor stops asking Serve every
    interval; health checks do not wake it, the first request does, and it asks at once."""
    from gateway.ingress import replica_monitor

    monkeypatch.setattr(replica_monitor, "IDLE_AFTER_S", 0.3)
    handle, asked = _Handle(), []

    class _Monitored(ServeEngineClient):
        def _running_replicas(self) -> int:
            asked.append(time.monotonic())
            return 1

    # Idle, it would ask again only an hour later: every question below is a wake-up's.
    client = _Monitored(handle, "m", monitor_interval_s=0.05, idle_monitor_interval_s=3600)
    with pytest.raises(EngineUnavailable):
        await client.model_info()  # a request: starts the monitor, which asks tick after tick
    while len(asked) < 2:
        await asyncio.sleep(0.01)
    await asyncio.sleep(2)  # well past IDLE_AFTER_S: the monitor has gone idle
    idle = len(asked)
    await client.check_health()  # answered from the last reading: no question, no wake-up
    await asyncio.sleep(1)
    assert len(asked) == idle, asked
    with pytest.raises(EngineUnavailable):
        await client.model_info()  # the first request after the pause

    async def asked_again() -> None:
        while len(asked) == idle:
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(asked_again(), 10)  # a hang guard only
    finally:
        client._monitor.task.cancel()


async def test_every_models_monitor_shares_one_serve_status_per_tick(monkeypatch):
    """One ``serve.status()`` (every application's status, from the controller) per tick for
    all of an ingress's models, not one per model."""
    from types import SimpleNamespace

    from gateway.ingress import engine_client, serve_status

    reads = []

    def status():  # what Serve's controller answers: both models' deployments running
        reads.append(time.monotonic())
        deployments = {name: SimpleNamespace(replica_states={"RUNNING": 1})
                       for name in ("engine-m", "engine-n")}
        return SimpleNamespace(applications={"default": SimpleNamespace(deployments=deployments)})

    monkeypatch.setattr(serve_status.serve, "status", status)
    monkeypatch.setattr(engine_client, "SERVE_STATUS", serve_status.ServeStatus())
    monkeypatch.setattr(serve_status.ray, "is_initialized", lambda: True)
    asked: dict[str, int] = {"engine-m": 0, "engine-n": 0}

    class _Counted(ServeEngineClient):
        def _running_replicas(self) -> int:
            asked[self._handle.deployment_name] += 1
            return super()._running_replicas()

    handles = [_Handle(), _Handle()]
    handles[1].deployment_name = "engine-n"
    clients = [_Counted(h, "m", monitor_interval_s=0.5) for h in handles]
    for client in clients:
        assert await client.available()  # starts its monitor

    async def three_ticks_each() -> None:
        while min(asked.values()) < 3:
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(three_ticks_each(), 30)  # a hang guard only
    finally:
        for client in clients:
            client._monitor.task.cancel()
    assert all(client._monitor.running == 1 for client in clients)
    # Both asked each tick; Serve was read about once a tick (a tick that one monitor's loop
    # reached over a quarter second late, on a loaded box, reads again).
    assert len(reads) <= sum(asked.values()) / 2 + 1, (len(reads), asked)

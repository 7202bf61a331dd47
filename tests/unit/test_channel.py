"""The engine → ingress token channel (``engines.channel``) over real localhost sockets: what
each stream receives, how steps coalesce into frames, and what either end's death does."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from contract import FinalEvent, TokenEvent, Usage
from engines import channel as channel_module
from engines.channel import (
    ChannelAddress,
    ChannelLost,
    ChannelReceiver,
    ChannelSender,
    ChannelUnreachable,
)


def _final(n: int) -> FinalEvent:
    return FinalEvent(finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=n))


async def _generation(n: int, step: asyncio.Event | None = None, closed: list | None = None):
    """``n`` tokens, one per ``step`` (set by the test: one engine step for every stream)."""
    try:
        for i in range(n):
            if step is not None:
                await step.wait()
                await asyncio.sleep(0)
            yield TokenEvent(token_id=i, text=f"t{i}")
        yield _final(n)
    finally:
        if closed is not None:
            closed.append(True)


async def _received(inbox) -> list:
    return [event async for batch in inbox for event in batch]


async def _until(condition, timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.fixture
async def ends():
    receiver, sender = ChannelReceiver(), ChannelSender()
    yield receiver, sender
    sender.close()
    await receiver.close()


async def test_streams_arrive_whole_in_order_and_a_step_is_one_frame(ends, monkeypatch):
    receiver, sender = ends
    frames = []
    deliver = receiver._deliver

    def counted(frame, connection):
        frames.append(len(frame.parts))
        return deliver(frame, connection)

    monkeypatch.setattr(receiver, "_deliver", counted)
    step = asyncio.Event()
    inboxes = [await receiver.open() for _ in range(8)]
    sends = [asyncio.ensure_future(sender.stream(inbox.address, _generation(20, step)))
             for inbox in inboxes]
    readers = [asyncio.ensure_future(_received(inbox)) for inbox in inboxes]

    async def steps():
        while not all(s.done() for s in sends):
            step.set()
            await asyncio.sleep(0.005)  # the engine's step time
            step.clear()
            await asyncio.sleep(0.005)

    stepper = asyncio.ensure_future(steps())
    assert await asyncio.wait_for(asyncio.gather(*sends), 10) == [21] * 8
    streams = await asyncio.wait_for(asyncio.gather(*readers), 10)
    stepper.cancel()
    for events in streams:
        assert [e.token_id for e in events[:-1]] == list(range(20)) and events[-1] == _final(20)
    # 8 streams x 21 events: one frame per step carries every stream's token of that step
    assert len(frames) <= 30 and max(frames) == 8, frames


@pytest.mark.parametrize("secret", ["0" * 32, "é" * 32])
async def test_an_unknown_secret_is_refused(ends, secret, caplog):
    receiver, sender = ends
    inbox = await receiver.open()
    forged = ChannelAddress(inbox.address.host, inbox.address.port, secret, inbox.address.key)
    closed: list = []
    with pytest.raises((ChannelLost, asyncio.CancelledError)):
        await asyncio.wait_for(sender.stream(forged, _generation(10**6, closed=closed)), 10)
    assert closed  # the generation was closed: the engine aborts it
    assert inbox._events == []
    assert "wrong secret refused" in caplog.text  # refused as such, not by a TypeError


async def test_an_unreachable_ingress_is_named_so_the_ingress_can_fall_back():
    with contextlib.closing(__import__("socket").socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nobody listens there once closed
    with pytest.raises(ChannelUnreachable):
        await ChannelSender().stream(ChannelAddress("127.0.0.1", port, "s", 1), _generation(1))


async def test_a_dead_ingress_aborts_every_generation_sent_to_it(ends):
    receiver, sender = ends
    closed: list = []
    step = asyncio.Event()
    inboxes = [await receiver.open() for _ in range(3)]
    sends = [asyncio.ensure_future(sender.stream(i.address, _generation(10**6, step, closed)))
             for i in inboxes]
    step.set()
    await _until(lambda: all(i._events for i in inboxes))
    await receiver.close()  # closes its connections, as the process's death does
    done, _ = await asyncio.wait(sends, timeout=10)
    assert len(done) == 3 and len(closed) == 3


async def test_a_dead_engine_replica_fails_its_streams_at_once(ends):
    receiver, sender = ends
    inbox = await receiver.open()
    step = asyncio.Event()
    send = asyncio.ensure_future(sender.stream(inbox.address, _generation(10**6, step)))
    step.set()
    reading = asyncio.ensure_future(_received(inbox))
    await _until(lambda: inbox.connection is not None)
    sender.close()  # as the engine replica's process exit does
    with pytest.raises(ChannelLost):
        await asyncio.wait_for(reading, 10)
    with contextlib.suppress(asyncio.CancelledError, ChannelLost):
        await send


async def test_a_call_that_returns_without_its_last_frame_ends_in_an_error(ends, monkeypatch):
    receiver, _ = ends
    monkeypatch.setattr(channel_module, "_END_GRACE_S", 0.05)
    inbox = await receiver.open()
    call = asyncio.get_running_loop().create_future()
    call.set_result(0)
    inbox.call_finished(call)
    with pytest.raises(ChannelLost):
        await asyncio.wait_for(_received(inbox), 10)
    failed = await receiver.open()
    call = asyncio.get_running_loop().create_future()
    call.set_exception(RuntimeError("replica died"))
    failed.call_finished(call)
    with pytest.raises(RuntimeError, match="replica died"):
        await asyncio.wait_for(_received(failed), 10)


async def test_a_slow_ingress_holds_its_streams_back_instead_of_buffering(monkeypatch):
    """An ingress that stops reading: the engine's side waits once its backlog is full."""
    monkeypatch.setattr(channel_module, "_BACKLOG_EVENTS", 16)
    accepted: list = []

    async def never_reads(reader, writer):
        accepted.append(writer)
        await asyncio.Event().wait()

    server = await asyncio.start_server(never_reads, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    produced = 0

    async def big():
        nonlocal produced
        while True:
            produced += 1
            yield TokenEvent(token_id=produced, text="x" * 65536)

    sender = ChannelSender()
    send = asyncio.ensure_future(sender.stream(ChannelAddress("127.0.0.1", port, "s", 1), big()))
    await asyncio.sleep(1.0)
    stalled_at = produced
    await asyncio.sleep(0.5)
    assert produced == stalled_at and not send.done()
    assert produced < 2000  # a few socket buffers' worth, not everything the engine could make
    send.cancel()
    sender.close()
    server.close()


async def test_a_stream_the_ingress_stopped_reading_is_aborted_by_the_channel_alone(ends):
    """Even if the Serve call's cancellation never reaches the engine replica."""
    receiver, sender = ends
    closed: list = []
    step = asyncio.Event()
    kept, dropped = await receiver.open(), await receiver.open()
    keep = asyncio.ensure_future(sender.stream(kept.address, _generation(10**6, step)))
    drop = asyncio.ensure_future(sender.stream(dropped.address, _generation(10**6, step, closed)))
    step.set()
    await _until(lambda: dropped._events)
    dropped.close()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(drop, 10)
    assert closed == [True] and not keep.done()  # the other stream goes on
    keep.cancel()


async def test_the_engine_forgets_the_connections_of_ingress_replicas_gone():
    sender, gone, live = ChannelSender(), ChannelReceiver(), ChannelReceiver()
    inbox = await gone.open()
    await sender.stream(inbox.address, _generation(1))
    await gone.close()  # that ingress replica died
    await _until(lambda: all(c.closed for c in sender._connections.values()))
    inbox = await live.open()
    await sender.stream(inbox.address, _generation(1))
    assert [c.closed for c in sender._connections.values()] == [False]
    sender.close()
    await live.close()

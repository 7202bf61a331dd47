"""contract.pump: several streams read as one, what each of its users relies on."""

from __future__ import annotations

import asyncio

import pytest

from contract.pump import Pump


async def _count(n: int, closed: list | None = None, delay: float = 0.0, fail: bool = False):
    try:
        for i in range(n):
            if delay:
                await asyncio.sleep(delay)
            yield i
        if fail:
            raise ValueError("boom")
    finally:
        if closed is not None:
            closed.append(True)


async def _read(pump: Pump) -> list:
    return [item async for item in pump.items()]


async def test_items_of_every_stream_in_each_streams_order():
    async with Pump(4) as pump:
        pump.start(_count(5, delay=0.001))
        pump.start(_count(3, delay=0.0015))
        got = await _read(pump)
    assert sorted(got) == [0, 0, 1, 1, 2, 2, 3, 4]
    assert [x for x in got if x > 2] == [3, 4]


async def test_a_streams_exception_reaches_the_reader():
    async with Pump(4) as pump:
        pump.start(_count(2, fail=True))
        with pytest.raises(ValueError, match="boom"):
            await _read(pump)


async def test_a_stream_cancelled_before_it_ran_ends_for_the_reader():
    async with Pump(4) as pump:
        pump.start(_count(3))
        pump.start(_count(10**6)).cancel()  # its caller is gone before it started
        assert await asyncio.wait_for(_read(pump), 5) == [0, 1, 2]


async def test_a_stream_cancelled_while_the_queue_is_full_still_ends():
    async with Pump(2) as pump:
        task = pump.start(_count(10**6))
        while pump._queue.qsize() < 2:  # the reader is behind: the stream waits on a full queue
            await asyncio.sleep(0.001)
        task.cancel()
        got = await asyncio.wait_for(_read(pump), 5)
    assert got[:2] == [0, 1]


async def test_leaving_the_reader_closes_every_stream():
    closed: list = []
    async with Pump(2) as pump:
        for _ in range(3):
            pump.start(_count(10**6, closed, delay=0.001))
        async for _ in pump.items():
            break
    assert closed == [True, True, True]


async def test_streams_started_while_reading_are_read_too():
    async with Pump(4) as pump:
        pump.start(_count(1))
        got = []
        async for item in pump.items():
            got.append(item)
            if len(got) == 1:
                pump.start(_count(2))  # a fork announced by the first stream
    assert got == [0, 0, 1]


async def test_batches_hold_what_has_arrived_and_end_after_the_last():
    async with Pump(100) as pump:
        pump.start(_count(20))
        await asyncio.sleep(0.05)  # all arrived before the first read
        batches = [batch async for batch in pump.batches()]
    assert batches == [list(range(20))]

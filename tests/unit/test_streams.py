"""Protocol-neutral stream helpers and the replica's adaptive batching."""

import asyncio

from contract import ErrorEvent, FinalEvent, TokenEvent, Usage
from engines.replica.deployment import drain_batches
from protocols.streams import merge, peek, reindexed


def _tok(i, index=0):
    return TokenEvent(index=index, token_id=i, text=str(i))


async def _gen(events, delay=0.0, started=None, closed=None):
    try:
        if started is not None:
            started.set()
        for event in events:
            if delay:
                await asyncio.sleep(delay)
            yield event
    finally:
        if closed is not None:
            closed.set()


async def _list(agen):
    return [x async for x in agen]


async def test_peek_replays_first_event_and_reports_errors():
    peeked = await peek(_gen([_tok(1), _tok(2)]))
    assert peeked.error is None
    assert await _list(aiter(peeked)) == [_tok(1), _tok(2)]
    error = ErrorEvent(kind="validation", message="no")
    assert (await peek(_gen([error]))).error == error
    assert (await peek(_gen([]))).first is None


async def test_reindexed_shifts_choice_indices():
    final = FinalEvent(index=1, finish_reason="length", usage=Usage(prompt_tokens=1,
                                                                     completion_tokens=1))
    out = await _list(reindexed(_gen([_tok(1, 0), final]), base=4))
    assert [e.index for e in out] == [4, 5]


async def test_merge_keeps_order_within_each_stream():
    a = [_tok(i, 0) for i in range(5)]
    b = [_tok(i, 1) for i in range(5)]
    out = await _list(merge([_gen(a, 0.001), _gen(b, 0.0015)]))
    assert [e for e in out if e.index == 0] == a
    assert [e for e in out if e.index == 1] == b


async def test_merge_stops_at_first_error_and_closes_the_rest():
    closed = asyncio.Event()
    slow = _gen([_tok(i, 1) for i in range(100)], 0.01, closed=closed)
    out = await _list(merge([_gen([ErrorEvent(kind="engine", message="x")]), slow]))
    assert isinstance(out[-1], ErrorEvent)
    await asyncio.wait_for(closed.wait(), 1)


async def test_drain_batches_is_one_per_item_when_consumer_keeps_up():
    batches = await _list(drain_batches(_gen([_tok(i) for i in range(4)], delay=0.005)))
    assert [len(b) for b in batches] == [1, 1, 1, 1]


async def test_drain_batches_coalesces_when_consumer_lags():
    batches = []
    async for batch in drain_batches(_gen([_tok(i) for i in range(20)])):
        batches.append(batch)
        await asyncio.sleep(0.01)
    assert sum(len(b) for b in batches) == 20 and len(batches) < 20
    assert [e.token_id for b in batches for e in b] == list(range(20))


async def test_drain_batches_close_cancels_the_producer():
    closed = asyncio.Event()
    stream = drain_batches(_gen([_tok(i) for i in range(1000)], 0.01, closed=closed))
    await anext(stream)
    await stream.aclose()
    await asyncio.wait_for(closed.wait(), 1)


async def test_a_dead_callers_streams_end_and_their_engine_requests_close():
    """engines.replica.callers: the ingress that asked died; its generations are aborted (the engine
    stream closed), another caller's go on, and the stream ends without raising."""
    from engines.replica.callers import CallerWatch

    dead, alive = ("SERVE_REPLICA::gateway#GatewayIngress#dead", "serve"), ("other", "serve")
    watch = CallerWatch(alive=lambda caller: caller != dead, interval_s=0.05)
    closed_dead, closed_alive = asyncio.Event(), asyncio.Event()
    orphan = drain_batches(_gen([_tok(i) for i in range(1000)], 0.01, closed=closed_dead),
                           lambda task: watch.track(dead, task))
    kept = drain_batches(_gen([_tok(i) for i in range(30)], 0.01, closed=closed_alive),
                         lambda task: watch.track(alive, task))
    got = await asyncio.wait_for(_list(orphan), 5)
    assert 0 < sum(len(b) for b in got) < 1000  # ended early, quietly
    await asyncio.wait_for(closed_dead.wait(), 1)
    assert watch.cancelled == 1
    assert sum(len(b) for b in await _list(kept)) == 30 and closed_alive.is_set()
    # No calls in flight: the watch loop ends after its current check. Bounded, not a fixed
    # sleep: the check runs in the default thread pool, which a loaded CI box can hold up
    # (0.15 s was too short there, at the end of a 40-minute suite).
    assert watch._loop is not None
    await asyncio.wait_for(asyncio.shield(watch._loop), 5)
    assert watch._loop.done() and not watch._tasks


async def test_a_caller_check_that_fails_cancels_nothing():
    from engines.replica.callers import CallerWatch

    def broken(caller):
        raise ConnectionError("GCS restarting")

    watch = CallerWatch(alive=broken, interval_s=0.02)
    stream = drain_batches(_gen([_tok(i) for i in range(10)], 0.01),
                           lambda task: watch.track(("x", "serve"), task))
    assert sum(len(b) for b in await _list(stream)) == 10 and watch.cancelled == 0

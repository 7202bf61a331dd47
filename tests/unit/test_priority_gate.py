"""The replica's priority gate (engines/replica/priority_gate.py; docs/tenancy.md): what runs, what
waits, in which order, and the headroom a flood of a worse priority leaves free."""

from __future__ import annotations

import asyncio

import pytest

from engines.kit.config import ModelConfig, Scheduling
from engines.replica.priority_gate import PriorityGate


async def _hold(gate: PriorityGate, priority: int, order: list, release: asyncio.Event):
    async with gate.slot(priority):
        order.append(priority)
        await release.wait()


async def test_waiting_requests_start_best_priority_first():
    gate, order, release = PriorityGate(max_running=1), [], asyncio.Event()
    first = asyncio.create_task(_hold(gate, 5, order, release))
    await asyncio.sleep(0)
    waiting = [asyncio.create_task(_hold(gate, p, order, release)) for p in (3000, 1000, 2000)]
    await asyncio.sleep(0)
    assert order == [5] and gate.waiting == 3
    release.set()
    await asyncio.gather(first, *waiting)
    assert order == [5, 1000, 2000, 3000]


async def test_a_flood_leaves_the_headroom_to_a_better_priority():
    gate, order, release = PriorityGate(max_running=4, headroom=1), [], asyncio.Event()
    flood = [asyncio.create_task(_hold(gate, 3000, order, release)) for _ in range(10)]
    await asyncio.sleep(0)
    assert order == [3000] * 3  # the fourth slot is kept
    better = asyncio.create_task(_hold(gate, 1000, order, release))
    await asyncio.sleep(0)
    assert order[-1] == 1000 and sum(gate.running.values()) == 4
    release.set()
    await asyncio.gather(*flood, better)
    assert len(order) == 11 and not gate.running


async def test_a_caller_that_leaves_while_waiting_takes_no_slot():
    gate, order, release = PriorityGate(max_running=1), [], asyncio.Event()
    first = asyncio.create_task(_hold(gate, 1, order, release))
    await asyncio.sleep(0)
    gone = asyncio.create_task(_hold(gate, 1, order, release))
    after = asyncio.create_task(_hold(gate, 2, order, release))
    await asyncio.sleep(0)
    gone.cancel()
    release.set()
    await asyncio.gather(first, after)
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert order == [1, 2] and not gate.running and gate.waiting == 0


def test_scheduling_is_validated():
    assert ModelConfig(scheduling=Scheduling(max_running=8, headroom=2)).scheduling.headroom == 2
    for bad in ({"max_running": 2, "headroom": 2}, {"headroom": 1}):
        with pytest.raises(ValueError):
            Scheduling(**bad)


async def test_the_host_holds_generations_to_its_gate_and_their_deadlines():
    from contract import FinalEvent, GenerateRequest, Sampling, TextPrompt
    from tests.fake_engine import FakeEngine

    engine = FakeEngine(delay=0.02)
    engine.gate = PriorityGate(max_running=1)

    async def run(request_id: str, priority: int, timeout_s: float | None = None):
        request = GenerateRequest(request_id=request_id, model="fake-model",
                                  prompt=TextPrompt(text="Hi"), sampling=Sampling(max_tokens=4),
                                  priority=priority, timeout_s=timeout_s)
        events = [e async for e in engine.generate(request)]
        finals = [e for e in events if isinstance(e, FinalEvent)]
        return request_id, finals[-1].finish_reason

    first = asyncio.create_task(run("first", 5))
    await asyncio.sleep(0.005)
    results = await asyncio.gather(first, run("low", 9), run("high", 1),
                                   run("impatient", 0, timeout_s=0.01))
    assert dict(results)["impatient"] == "abort"  # its deadline ran out while it waited
    assert engine.started == 4 and not engine.gate.running

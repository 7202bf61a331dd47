"""RayStages' health policy over the stage channel (docs/protocols/pipeline.md, "The stage
channel"): which stages it respawns, and what a stage's death does to micro-batches in flight.
Ray's actors are stood in for by objects with the same methods (their calls answer at once); the
end-to-end suite kills real stage actors (tests/e2e/test_pipeline_e2e.py)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from engines.pipeline.stage import Hop
from engines.pipeline.stages import RayStages, Resolved
from engines.pipeline.wire import StageLost


class _Call:
    """``actor.method.remote(...)``: an awaitable answer, or a future that never completes."""

    def __init__(self, answer):
        self.answer = answer

    def remote(self, *args):
        if isinstance(self.answer, Future):
            return SimpleNamespace(future=lambda: self.answer)
        answer = self.answer

        async def call():
            if isinstance(answer, BaseException):
                raise answer
            return answer

        return call()


class _Actor:
    def __init__(self, stuck_s: float = 0.0, dead: bool = False):
        self.where = _Call(RayActorError() if dead else {"address": "tcp://x:1",
                                                         "stuck_s": stuck_s})
        self.vigil = _Call(Future())
        self.sweep = SimpleNamespace(remote=lambda: None)  # fire and forget


class _Wire:
    def __init__(self):
        self.failed: list[BaseException] = []

    def fail_all(self, error):
        self.failed.append(error)


def _stages(*actors) -> RayStages:
    stages = RayStages.__new__(RayStages)  # no Ray: only the policy is under test
    stages.actors, stages.ranges = list(actors), [(1, 2)] * len(actors)
    stages.args = SimpleNamespace(step_timeout_s=60.0)
    stages.wire, stages._lost = _Wire(), None
    stages._generations, stages._vigils = [0] * len(actors), [None] * len(actors)
    stages._recovering = asyncio.Lock()
    stages.respawned = []

    async def respawn(i):
        stages.respawned.append(i)
        stages.actors[i] = _Actor()

    stages._respawn = respawn
    return stages


async def test_a_dead_stage_and_a_hung_one_are_respawned_a_busy_one_is_not():
    stages = _stages(_Actor(stuck_s=5), _Actor(dead=True), _Actor(stuck_s=120))
    stages._lost = "stage 1 is gone"
    await stages.recover(patience=60)
    assert stages.respawned == [1, 2]
    assert stages._lost is None  # the pipe is whole again: submissions go out


async def test_the_health_check_recovers_a_stage_whose_hop_runs_past_the_step_timeout():
    stages = _stages(_Actor(), _Actor(stuck_s=61))
    await stages.check(busy=True)
    assert stages.respawned == [1]
    healthy = _stages(_Actor(stuck_s=30), _Actor())
    await healthy.check(busy=True)
    assert healthy.respawned == []


def test_a_stages_death_fails_what_is_in_flight_and_refuses_new_hops_until_recovered():
    stages = _stages(_Actor(), _Actor())
    stages._watch(1, stages.actors[1])
    stages.actors[1].vigil.answer.set_exception(RayActorError())  # Ray: the process is gone
    assert isinstance(stages.wire.failed[-1], StageLost) and "stage 1" in stages._lost
    refused = stages.submit(Hop(None, None, ("s",), (1,), 0), check=False)
    assert isinstance(refused, Resolved) and isinstance(refused.error, StageLost)


def test_a_stage_replaced_on_purpose_does_not_break_the_pipe_when_its_vigil_ends():
    stages = _stages(_Actor(), _Actor())
    old = stages.actors[0]
    stages._watch(0, old)
    stages._generations[0] += 1  # what _respawn does before it kills the old actor
    old.vigil.answer.set_exception(RayActorError())
    assert stages._lost is None and not stages.wire.failed


@pytest.mark.parametrize("busy", [True, False])
async def test_a_stage_that_does_not_answer_its_health_check(busy, monkeypatch):
    import engines.pipeline.stages as module

    class Silent(_Actor):
        def __init__(self):
            super().__init__()
            self.where = SimpleNamespace(remote=lambda: asyncio.sleep(3600))

    monkeypatch.setattr(module, "_ANSWER_S", 0.01)
    stages = _stages(Silent())
    if busy:  # its threads may be slow while it computes: the step timeout decides
        await stages.check(busy=True)
    else:
        with pytest.raises(TimeoutError):
            await stages.check(busy=False)
    assert stages.respawned == []

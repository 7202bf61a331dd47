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

from engines.pipeline.stages import RayStages
from engines.pipeline.wire import StageLost


class _Call:
    """``actor.method.remote(...)``: an awaitable answer, or (a Future) a call whose
    reference's ``future()`` is that future."""

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
    def __init__(self, stuck_s: float = 0.0, dead: bool = False, address: str = "tcp://x:1"):
        self.where = _Call(RayActorError() if dead else {"address": address,
                                                         "stuck_s": stuck_s})
        self.vigil = _Call(Future())
        self.sweep = SimpleNamespace(remote=lambda: None)  # fire and forget
        self.links: list[str] = []
        self.connect = SimpleNamespace(remote=self._connect)

    async def _connect(self, address):
        self.links.append(address)


class _Wire:
    address = "tcp://origin:1"

    def __init__(self):
        self.failed: list[BaseException] = []
        self.broken_by: BaseException | None = None
        self.first: str | None = None

    def fail_all(self, error):
        self.failed.append(error)
        self.broken_by = error

    def mend(self):
        self.broken_by = None

    def broken(self):
        return self.broken_by

    def connect(self, address):
        self.first = address

    def submit(self, hop, check):
        future: Future = Future()
        future.set_exception(StageLost(str(self.broken_by)))
        return future

    def forget(self, step):
        pass


def _stages(*actors) -> RayStages:
    stages = RayStages.__new__(RayStages)  # no Ray: only the policy is under test
    stages.actors, stages.ranges = list(actors), [(1, 2)] * len(actors)
    stages.addresses = ["tcp://x:1"] * len(actors)
    stages.args = SimpleNamespace(step_timeout_s=60.0)
    stages.wire, stages._deaths = _Wire(), 0
    stages._generations = [1] * len(actors)
    stages._vigils = [None] * len(actors)
    for i, actor in enumerate(actors):
        stages._watch(i, actor)
    stages._recovering = asyncio.Lock()
    stages.respawned = []

    async def respawn(i):
        stages.respawned.append(i)
        stages._generations[i] += 1
        stages.actors[i] = _Actor()
        stages._watch(i, stages.actors[i])

    stages._respawn = respawn
    return stages


async def test_a_dead_stage_and_a_hung_one_are_respawned_a_busy_one_is_not():
    stages = _stages(_Actor(stuck_s=5), _Actor(dead=True), _Actor(stuck_s=40))
    stages.wire.fail_all(StageLost("stage 1 is gone"))
    await stages.recover(patience=60)  # a hop running past half the patience is hung
    assert stages.respawned == [1, 2]
    assert stages.wire.broken() is None  # the pipe is whole again: submissions go out


async def test_a_stage_at_another_address_than_wired_is_wired_in_again():
    """A respawn whose wiring did not finish (its wait ran out): the next recovery finds the
    stage answering at its new address and links its neighbours to it."""
    stages = _stages(_Actor(), _Actor(address="tcp://moved:2"), _Actor())
    await stages.recover(patience=60)
    assert stages.respawned == [] and stages.addresses[1] == "tcp://moved:2"
    assert stages.actors[0].links == ["tcp://moved:2"]  # its predecessor sends to it
    assert stages.actors[1].links == ["tcp://x:1"]  # and it to its successor
    first = _stages(_Actor(address="tcp://moved:3"), _Actor())
    await first.recover(patience=60)
    assert first.wire.first == "tcp://moved:3"  # the origin sends to a moved first stage


async def test_a_death_during_a_recovery_keeps_the_pipe_broken_until_recovered_again():
    stages = _stages(_Actor(), _Actor())
    dying = stages.actors[1]
    original = dying.where

    class DiesWhenAsked:
        def remote(self):
            dying.vigil.answer.set_exception(RayActorError())  # gone right after it answered
            dying.where = _Call(RayActorError())
            return original.remote()

    dying.where = DiesWhenAsked()
    await stages.recover(patience=60)
    assert stages.respawned == [1]  # the second pass found it dead and respawned it
    assert stages.wire.broken() is None


async def test_the_health_check_recovers_a_stage_whose_hop_runs_past_the_step_timeout():
    stages = _stages(_Actor(), _Actor(stuck_s=61))
    await stages.check(busy=True)
    assert stages.respawned == [1]
    healthy = _stages(_Actor(stuck_s=20), _Actor())
    await healthy.check(busy=True)
    assert healthy.respawned == []


def test_a_stages_death_fails_what_is_in_flight_and_refuses_new_hops_until_recovered():
    stages = _stages(_Actor(), _Actor())
    stages.actors[1].vigil.answer.set_exception(RayActorError())  # Ray: the process is gone
    assert isinstance(stages.wire.failed[-1], StageLost) and stages._deaths == 1
    assert "stage 1" in str(stages.wire.broken())


def test_a_stage_replaced_on_purpose_does_not_break_the_pipe_when_its_vigil_ends():
    stages = _stages(_Actor(), _Actor())
    old = stages.actors[0]
    stages._generations[0] += 1  # what _respawn does before it kills the old actor
    old.vigil.answer.set_exception(RayActorError())
    assert stages.wire.broken() is None and not stages.wire.failed and stages._deaths == 0


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

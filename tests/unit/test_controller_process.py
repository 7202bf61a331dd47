"""The controller runtime in a process of its own (engines/controllers/runtime/process.py), and the
replica's side of its metrics (engines/controllers/runtime/service.py's ``AttachedRuntime``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import msgspec
import psutil
import pytest

from engines.controllers.ipc.channels import MainClient, SideClient
from engines.controllers.ipc.messages import RuntimeStats
from engines.controllers.ipc.shm import ChannelObjects
from engines.controllers.runtime.process import RuntimeProcess, RuntimeStart
from engines.controllers.runtime.runtime import Limits
from engines.controllers.runtime.service import AttachedRuntime
from engines.kit.telemetry import STEP_BUCKETS_S, EngineMetrics, Levels, Tally
from tests.processes import gone_within

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def objects():
    """The replica's shm objects under a prefix no other test uses."""
    made = ChannelObjects(f"/t{os.getpid()}-{uuid.uuid4().hex[:6]}-")
    yield made
    made.close()


def _start(objects: ChannelObjects, tiny_dir: Path, **custom: str) -> RuntimeStart:
    return RuntimeStart(objects.prefix, str(tiny_dir), 49152, custom, Limits())


def test_the_runtime_process_serves_both_channels_and_ends_when_closed(objects, tiny_dir):
    runtime = RuntimeProcess("tiny", _start(objects, tiny_dir))
    main, side = MainClient(objects.prefix, create=False), SideClient(objects.prefix, create=False)
    try:
        assert main.call("tokens", timeout=10) == {"vocab_size": 49152}
        tags = side.call("get_tags", timeout=10)["tags"]
        assert {"llguidance", "none"} <= {t["tag"] for t in tags}
        stats = side.call("get_stats", timeout=10)
        assert stats["live"] == 0 and stats["timeouts"] == {"mid": 0, "pre_post": 0}
        assert stats["step"]["counts"] == [0] * (len(STEP_BUCKETS_S) + 1)
        # The process is the replica's child, named by its model where `ps` shows it.
        child = psutil.Process(runtime.pid)
        assert child.ppid() == os.getpid()
        assert child.cmdline()[-3:] == ["-m", "engines.controllers.runtime.process", "tiny"]
    finally:
        side.close()
        main.close()
        runtime.close()
    assert gone_within(runtime.pid, 1)


def test_a_runtime_process_that_cannot_start_says_why(objects, tiny_dir):
    with pytest.raises(RuntimeError, match=r"did not start: ModuleNotFoundError.*no_such_pkg"):
        RuntimeProcess("tiny", _start(objects, tiny_dir, mine="no_such_pkg.ctrl:Mine"))


REPLICA = textwrap.dedent("""
    import json, sys, time
    from engines.controllers.runtime.process import RuntimeProcess, RuntimeStart
    from engines.controllers.runtime.runtime import Limits
    from engines.controllers.ipc.shm import ChannelObjects
    prefix, model_dir = sys.argv[1], sys.argv[2]
    objects = ChannelObjects(prefix)
    runtime = RuntimeProcess("tiny", RuntimeStart(prefix, model_dir, 49152, {}, Limits()))
    print(json.dumps({"runtime": runtime.pid}), flush=True)
    time.sleep(600)
""")


def test_a_runtime_process_ends_when_its_replica_is_killed(tiny_dir):
    """A replica killed outright closes nothing: the runtime learns of it from its stdin."""
    prefix = f"/t{os.getpid()}-{uuid.uuid4().hex[:6]}-"
    replica = subprocess.Popen([sys.executable, "-c", REPLICA, prefix, str(tiny_dir)], cwd=ROOT,
                               stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        runtime = json.loads(replica.stdout.readline())["runtime"]  # type: ignore[union-attr]
        assert psutil.Process(runtime).ppid() == replica.pid
        replica.kill()
        replica.wait(10)
        assert gone_within(runtime, 5)
    finally:
        if replica.poll() is None:
            replica.kill()
        ChannelObjects(prefix).close()  # the killed replica's: replaced, then removed


class FakeSide:
    """The side channel's client as the stats export uses it: ``sent``, ``call``."""

    def __init__(self) -> None:
        self.sent = 0
        self.answers: list[RuntimeStats] = []

    def call(self, op: str, timeout: float) -> dict:
        assert op == "get_stats"
        self.sent += 1
        return msgspec.to_builtins(self.answers.pop(0))

    def close(self) -> None:
        pass


class Closable:
    def close(self) -> None:
        pass


def _stats(steps: list[float], mid: int, live: int) -> RuntimeStats:
    tally = Tally.empty(STEP_BUCKETS_S)
    tally.count(steps, STEP_BUCKETS_S)
    return RuntimeStats(tally, {"mid": mid, "pre_post": 0}, live)


def test_the_replica_hands_on_only_what_is_new_and_asks_only_after_controllers_ran(
        monkeypatch, recorded):
    from engines.controllers.runtime import service

    metrics = EngineMetrics(recorded, recorded.keeper)
    monkeypatch.setattr(service, "engine_metrics", lambda: metrics)
    side = FakeSide()
    attached = AttachedRuntime("m", "/p-", Closable(), Closable(), side,  # type: ignore[arg-type]
                               levels=Levels(refresh_s=None))
    attached.export_stats()  # nothing sent over the side channel yet: not asked
    side.sent += 1  # a controlled request's instantiate
    side.answers.append(_stats([0.001, 0.002], mid=1, live=1))
    attached.export_stats()
    side.answers.append(_stats([0.001, 0.002, 0.3], mid=1, live=0))
    attached.export_stats()  # a controller was live: asked again
    attached.export_stats()  # none live, nothing sent since: not asked (no answer queued)
    recorded.keeper.refresh()
    assert recorded.level("llm_gateway_controller_step_seconds_count", model="m") == 3
    assert recorded.level("llm_gateway_controller_step_seconds_bucket", model="m",
                          le="0.5") == 3
    assert recorded.level("llm_gateway_controller_step_seconds_bucket", model="m",
                          le="0.25") == 2
    assert recorded.count("llm_gateway_controller_timeouts", model="m", kind="mid") == 1
    attached.close()

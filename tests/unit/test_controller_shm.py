"""The aicirt shared-memory transport (engines/controllers/ipc/shm.py), driven from both ends.

The oracle for the wire format is aicirt's (``docs/protocols/controller-runtime.md``): the
"foreign" ends below are written against raw ``posix_ipc`` and ``struct``, not this module, so
an engine end that only understood itself would fail them.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from engines.controllers.ipc.channels import (
    MainClient,
    MainServer,
    RuntimeReplyError,
    SideClient,
    SideServer,
    error_reply,
    ok_reply,
)
from engines.controllers.ipc.shm import (
    BiasMatrix,
    ChannelClosed,
    ChannelError,
    ChannelFull,
    ChannelTimeout,
    MessageSlot,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def prefix():
    """A prefix no other test (or run) uses; every object under it is gone afterwards."""
    pre = f"/t{os.getpid()}-{uuid.uuid4().hex[:6]}-"
    yield pre
    leftovers = []
    for slot in ("cmd", "resp", "cmd-side", "resp-side"):
        for sem in ("-wr", "-rd"):
            try:
                posix_ipc.unlink_semaphore(pre + slot + sem)
                leftovers.append(pre + slot + sem)
            except posix_ipc.ExistentialError:
                pass
    for shm in ("cmd-shm", "resp-shm", "cmd-side-shm", "resp-side-shm", "bin-shm"):
        try:
            posix_ipc.unlink_shared_memory(pre + shm)
            leftovers.append(pre + shm)
        except posix_ipc.ExistentialError:
            pass
    assert not leftovers, f"objects left behind: {leftovers}"


# --- a foreign end, written from the seed alone -------------------------------------------

class RawSlot:
    """One slot opened by hand: ``<name>-shm`` with u32 LE length + JSON at offset 0,
    ``<name>-wr`` / ``<name>-rd`` semaphores."""

    def __init__(self, name: str) -> None:
        shm = posix_ipc.SharedMemory(name + "-shm")
        self.map = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        self.wr = posix_ipc.Semaphore(name + "-wr")
        self.rd = posix_ipc.Semaphore(name + "-rd")

    def recv(self, timeout: float = 5) -> dict:
        self.rd.acquire(timeout)
        (n,) = struct.unpack("<I", self.map[0:4])
        body = self.map[4:4 + n]
        self.wr.release()
        return json.loads(body.decode("utf-8"))

    def send(self, obj: dict, timeout: float = 5) -> None:
        body = json.dumps(obj).encode("utf-8")
        self.wr.acquire(timeout)
        self.map[0:4] = struct.pack("<I", len(body))
        self.map[4:4 + len(body)] = body
        self.rd.release()

    def close(self) -> None:
        self.map.close()
        self.wr.close()
        self.rd.close()


def test_a_slot_holds_a_u32_little_endian_length_then_the_json_at_offset_zero(prefix):
    slot = MessageSlot(prefix + "cmd", 4096, create=True)
    try:
        slot.send(b'{"op":"ping"}', timeout=1)
        shm = posix_ipc.SharedMemory(prefix + "cmd-shm")
        raw = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        assert raw[0:4] == (13).to_bytes(4, "little")
        assert raw[4:17] == b'{"op":"ping"}'
        raw.close()
        # Semaphores as the seed names them: a message waits (rd 1), the slot is taken (wr 0).
        assert posix_ipc.Semaphore(prefix + "cmd-rd").value == 1
        assert posix_ipc.Semaphore(prefix + "cmd-wr").value == 0
        assert slot.recv(timeout=1) == b'{"op":"ping"}'
        assert posix_ipc.Semaphore(prefix + "cmd-wr").value == 1
    finally:
        slot.close()


def test_a_command_can_be_sent_and_its_answer_taken_later_one_at_a_time(prefix):
    # The hook sends a step before vLLM's forward pass and takes the answer after it.
    client = MainClient(prefix, size=1 << 16)
    cmd, resp = RawSlot(prefix + "cmd"), RawSlot(prefix + "resp")
    try:
        with pytest.raises(ChannelError, match="nothing was sent"):
            client.receive(timeout=1)
        client.send("step", timeout=5, mid_ops=[])
        assert client.waiting
        assert cmd.recv() == {"op": "step", "mid_ops": []}  # out before anyone waits
        with pytest.raises(ChannelError, match="before the answer"):
            client.send("ping", timeout=5)  # one in flight: answers are matched by order
        resp.send({"type": "ok", "data": {"mid": {}}})
        assert client.receive(timeout=5) == {"mid": {}} and not client.waiting
        resp.send({"type": "ok", "data": {"pong": 1}})
        assert client.call("ping", timeout=5) == {"pong": 1}
        assert cmd.recv() == {"op": "ping"}
    finally:
        cmd.close()
        resp.close()
        client.close()


def test_the_engine_end_talks_to_a_runtime_written_from_the_seed(prefix):
    client = MainClient(prefix, size=1 << 16)
    cmd, resp = RawSlot(prefix + "cmd"), RawSlot(prefix + "resp")
    seen = []

    def runtime():
        for _ in range(3):
            msg = cmd.recv()
            seen.append(msg)
            if msg["op"] == "ping":
                resp.send({"type": "ok", "data": {"pong": 1}})
            elif msg["op"] == "tokens":
                resp.send({"type": "ok", "data": {"vocab_size": 32003}})
            else:
                resp.send({"type": "error", "error": "unknown op", "is_user_error": True})

    thread = threading.Thread(target=runtime)
    thread.start()
    try:
        assert client.call("ping", timeout=5) == {"pong": 1}
        assert client.call("tokens", timeout=5) == {"vocab_size": 32003}
        with pytest.raises(RuntimeReplyError, match="unknown op") as err:
            client.call("nope", timeout=5, x=[1, 2])
        assert err.value.is_user_error
        assert seen == [{"op": "ping"}, {"op": "tokens"}, {"op": "nope", "x": [1, 2]}]
    finally:
        thread.join(5)
        cmd.close()
        resp.close()
        client.close()


def test_the_runtime_end_answers_an_engine_written_from_the_seed(prefix):
    # The engine creates the objects (as AICI's does); here by hand, with the seed's initial
    # semaphore values.
    made = []
    for name in ("cmd", "resp"):
        shm = posix_ipc.SharedMemory(prefix + name + "-shm", posix_ipc.O_CREX, size=1 << 16)
        shm.close_fd()
        made += [posix_ipc.Semaphore(prefix + name + "-wr", posix_ipc.O_CREX, initial_value=1),
                 posix_ipc.Semaphore(prefix + name + "-rd", posix_ipc.O_CREX, initial_value=0)]
    server = MainServer(prefix)
    thread = threading.Thread(target=server.serve, args=(lambda c: ok_reply({"echo": c}),))
    thread.start()
    cmd, resp = RawSlot(prefix + "cmd"), RawSlot(prefix + "resp")
    try:
        cmd.send({"op": "mid_process", "ops": [{"id": 2, "clone_id": None}]})
        assert resp.recv() == {"type": "ok", "data": {"echo": {
            "op": "mid_process", "ops": [{"id": 2, "clone_id": None}]}}}
        # Not JSON, and JSON without an op: answered, and the channel stays in step.
        cmd.wr.acquire(5)
        cmd.map[0:4] = struct.pack("<I", 3)
        cmd.map[4:7] = b"{{{"
        cmd.rd.release()
        bad = resp.recv()
        assert bad["type"] == "error" and bad["error"].startswith("json-error")
        cmd.send({"no": "op"})
        assert resp.recv()["type"] == "error"
        cmd.send({"op": "ping"})
        assert resp.recv()["data"] == {"echo": {"op": "ping"}}
    finally:
        server.close()
        thread.join(5)
        assert not thread.is_alive(), "close() must end serve()"
        cmd.close()
        resp.close()
        for sem in made:  # the engine end owns the objects: it removes them
            sem.unlink()
            sem.close()
        for name in ("cmd", "resp"):
            posix_ipc.unlink_shared_memory(prefix + name + "-shm")


def test_a_handler_exception_is_an_error_answer_not_a_dead_channel(prefix):
    client = MainClient(prefix, size=1 << 16)
    server = MainServer(prefix)

    def handler(command):
        if command["op"] == "boom":
            raise KeyError("no such sequence")
        return ok_reply({"pong": 1})

    thread = threading.Thread(target=server.serve, args=(handler,))
    thread.start()
    try:
        with pytest.raises(RuntimeReplyError, match="KeyError"):
            client.call("boom", timeout=5)
        assert client.call("ping", timeout=5) == {"pong": 1}
    finally:
        server.close()
        client.close()
        thread.join(5)


def test_finish_answers_the_current_command_before_serving_stops(prefix):
    client = MainClient(prefix, size=1 << 16)
    server = MainServer(prefix)

    def handler(command):
        if command["op"] == "stop":
            server.finish()
            time.sleep(0.05)  # the answer must not depend on the handler being quick
        return ok_reply({"op": command["op"]})

    thread = threading.Thread(target=server.serve, args=(handler,))
    thread.start()
    try:
        for _ in range(3):
            assert client.call("ping", timeout=5) == {"op": "ping"}
        assert client.call("stop", timeout=5) == {"op": "stop"}
        thread.join(5)
        assert not thread.is_alive()
    finally:
        server.close()
        client.close()
        thread.join(5)


def test_a_late_answer_leaves_the_main_channel_out_of_step_so_it_refuses_further_commands(prefix):
    client = MainClient(prefix, size=1 << 16)
    server = MainServer(prefix)
    release = threading.Event()

    def slow(command):
        release.wait(5)
        return ok_reply({})

    thread = threading.Thread(target=server.serve, args=(slow,))
    thread.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ChannelTimeout):
            client.call("mid_process", timeout=0.2, ops=[])
        assert time.monotonic() - t0 < 2
        release.set()
        with pytest.raises(ChannelError, match="out of step"):
            client.call("ping", timeout=1)
    finally:
        release.set()
        server.close()
        client.close()
        thread.join(5)


def test_a_message_larger_than_the_slot_is_refused_and_the_channel_still_works(prefix):
    client = MainClient(prefix, size=256)
    server = MainServer(prefix)
    thread = threading.Thread(target=server.serve, args=(lambda c: ok_reply({"n": len(c)}),))
    thread.start()
    try:
        with pytest.raises(ValueError, match="exceeds"):
            client.call("tokens", timeout=1, pad="x" * 300)
        assert client.call("ping", timeout=5) == {"n": 1}
    finally:
        server.close()
        client.close()
        thread.join(5)


# --- side channel -------------------------------------------------------------------------

def _side_pair(prefix, handler, **kw):
    client = SideClient(prefix, size=1 << 16, **kw)
    server = SideServer(prefix)
    thread = threading.Thread(target=server.serve, args=(handler,), daemon=True)
    thread.start()
    return client, server, thread


def test_side_answers_come_out_of_order_and_each_reaches_its_request_by_rid(prefix):
    held: list = []
    got_all = threading.Event()

    def handler(request, reply):
        held.append((request, reply))
        if len(held) == 3:
            got_all.set()

    client, server, thread = _side_pair(prefix, handler)
    auth = {"user": "alice", "is_admin": False}
    try:
        futs = [client.request("instantiate", auth, timeout=5, req_id=f"run-{i}", prompt=[1],
                               module_id="declctrl", module_arg="{}") for i in range(3)]
        assert got_all.wait(5)
        assert all(req["$auth"] == auth and req["$rid"] for req, _ in held)
        assert len({req["$rid"] for req, _ in held}) == 3
        for req, reply in reversed(held):  # the last request answered first
            reply(ok_reply({"req_id": req["req_id"]}))
        assert [f.result(5) for f in futs] == [{"req_id": f"run-{i}"} for i in range(3)]
        assert client.pending == 0
    finally:
        server.close()
        client.close()
        thread.join(5)


def test_requests_their_callers_gave_up_on_leave_the_client_working(prefix):
    # A task awaiting a side request that is cancelled (a client disconnect) cancels its
    # future; its answer, or its deadline, coming later must not kill the client's threads.
    held: list = []
    got = threading.Event()

    def handler(request, reply):
        held.append(reply)
        got.set()

    client, server, thread = _side_pair(prefix, handler)
    try:
        answered = client.request("get_tags", timeout=30)
        assert got.wait(5)
        assert answered.cancel()
        held[0](ok_reply({"tags": ["late"]}))  # the reader drops it
        expiring = client.request("get_tags", timeout=0.2)
        assert expiring.cancel()
        time.sleep(0.5)  # the deadline thread drops it
        got.clear()
        later = client.request("get_tags", timeout=5)
        assert got.wait(5)
        held[-1](ok_reply({"tags": ["ok"]}))
        assert later.result(5) == {"tags": ["ok"]}  # the reader still runs
        with pytest.raises(ChannelTimeout):  # and so does the deadline thread
            client.call("get_tags", timeout=0.3)
    finally:
        server.close()
        client.close()
        thread.join(5)


def test_side_errors_timeouts_and_the_bound_on_waiting_requests(prefix):
    waiting: list = []

    def handler(request, reply):
        if request["op"] == "mk_module":
            reply(error_reply("Wasm modules are not supported", is_user_error=True))
        elif request["op"] == "raise":
            raise ValueError("bad tag")
        else:
            waiting.append(reply)  # never answered

    client, server, thread = _side_pair(prefix, handler, max_pending=2)
    try:
        with pytest.raises(RuntimeReplyError, match="not supported") as err:
            client.call("mk_module", timeout=5, binary="AGFzbQ==")
        assert err.value.is_user_error
        with pytest.raises(RuntimeReplyError, match="ValueError: bad tag"):
            client.call("raise", timeout=5)
        t0 = time.monotonic()
        with pytest.raises(ChannelTimeout):
            client.call("get_tags", timeout=0.3)
        assert time.monotonic() - t0 < 2
        assert client.pending == 0  # a timed-out request does not hold a place
        first = client.request("get_tags", timeout=30)
        second = client.request("get_tags", timeout=30)
        with pytest.raises(ChannelFull):
            client.request("get_tags", timeout=30)
        # A late answer to a request that timed out is dropped, not misdelivered.
        waiting[0](ok_reply({"tags": ["late"]}))
        waiting[1](ok_reply({"tags": ["first"]}))
        assert first.result(5) == {"tags": ["first"]}
        assert not second.done()
    finally:
        server.close()
        client.close()
        thread.join(5)
    with pytest.raises(ChannelClosed):
        second.result(5)  # close() fails what still waits


# --- the bias matrix, and both ends in different processes --------------------------------

RUNTIME = r"""
import sys, threading
import numpy as np
from engines.controllers.ipc.shm import BiasMatrix
from engines.controllers.ipc.channels import MainServer, SideServer, ok_reply
prefix, vocab = sys.argv[1], int(sys.argv[2])
bias = BiasMatrix(prefix, create=False)
main, side = MainServer(prefix), SideServer(prefix)

def on_main(cmd):
    if cmd["op"] == "tokens":
        return ok_reply({"vocab_size": vocab})
    if cmd["op"] == "mid_process":
        rows = bias.rows(len(cmd["ops"]), vocab)
        for i, op in enumerate(cmd["ops"]):
            rows[i] = -np.inf
            rows[i, op["id"]] = 0.0  # sequence id n may only sample token n
        del rows
        seqs = {str(op["id"]): {"error": "", "result": None, "storage": [], "logs": "",
                                "micros": 1} for op in cmd["ops"]}
        return ok_reply({"seqs": seqs, "num_seqs": len(cmd["ops"])})
    if cmd["op"] == "stop":
        main.finish()  # the answer goes out before serve() returns
        return ok_reply({})
    return ok_reply({"pong": 1})

threading.Thread(target=side.serve, args=(lambda r, reply: reply(ok_reply({"op": r["op"]})),),
                 daemon=True).start()
main.serve(on_main)
main.close()
side.close()
"""


def test_bias_rows_come_back_in_the_order_of_mid_process_ops_across_processes(prefix):
    vocab = 1000
    bias = BiasMatrix(prefix, size=16 * vocab * 4, create=True)
    client = MainClient(prefix, size=1 << 16)
    side = SideClient(prefix, size=1 << 16)
    proc = subprocess.Popen([sys.executable, "-c", RUNTIME, prefix, str(vocab)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert client.call("tokens", timeout=30) == {"vocab_size": vocab}
        assert side.call("get_tags", timeout=5) == {"op": "get_tags"}
        ids = [7, 3, 911, 0, 42]
        data = client.call("mid_process", timeout=5,
                           ops=[{"id": i, "clone_id": None} for i in ids])
        assert data["num_seqs"] == len(ids) and set(data["seqs"]) == {str(i) for i in ids}
        rows = bias.rows(data["num_seqs"], vocab)
        assert [int(np.argmax(row)) for row in rows] == ids
        assert all(np.isneginf(row).sum() == vocab - 1 for row in rows)
        with pytest.raises(ValueError, match="exceed"):
            bias.rows(17, vocab)
        del rows
        client.call("stop", timeout=5)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        side.close()
        client.close()
        bias.close()


def test_closing_wakes_a_blocked_reader_at_once(prefix):
    client = SideClient(prefix, size=1 << 12)
    t0 = time.monotonic()
    client.close()  # the reader thread waits on resp-side with no bound
    assert time.monotonic() - t0 < 1
    assert not client._reader.is_alive()
    with pytest.raises(ChannelClosed):
        client.request("get_tags", timeout=1)


def test_a_side_request_times_out_on_its_own_bound_behind_a_longer_one(prefix):
    """One thread keeps every request's deadline: a short one queued behind a long one still
    fires on time, and an answered request never times out."""
    def handler(request, reply):
        if request["op"] == "ping":
            reply(ok_reply({"pong": 1}))  # the others are never answered

    client, server, thread = _side_pair(prefix, handler)
    try:
        slow = client.request("get_tags", timeout=30)
        answered = client.request("ping", timeout=0.2)
        t0 = time.monotonic()
        with pytest.raises(ChannelTimeout, match=r"within 0\.3 s"):
            client.call("get_tags", timeout=0.3)
        assert time.monotonic() - t0 < 2
        assert answered.result(1) == {"pong": 1} and not slow.done()
    finally:
        server.close()
        client.close()
        thread.join(5)

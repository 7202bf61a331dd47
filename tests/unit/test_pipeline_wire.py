"""The stage channel (``engines/pipeline/wire.py``; docs/protocols/pipeline.md, "The stage
channel"): real ZeroMQ sockets on loopback between in-process stage servers and the origin's
end, no Ray. Oracle: the same layers called in process (``StageCore.forward``), and the unsplit
model's greedy tokens through the origin's scheduler."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import pytest
import torch

from engines.pipeline.jobs import Job, Sequence
from engines.pipeline.loading import load_layers, load_origin
from engines.pipeline.origin import Origin
from engines.pipeline.stage import CacheMismatch, Hop, StageCore, digest
from engines.pipeline.stages import _Reply
from engines.pipeline.wire import (
    OriginWire,
    StageFailed,
    StageLost,
    StageServer,
    hop_frames,
    read_frames,
)
from tests.pipeline_models import build_tiny

HOST = "127.0.0.1"
RANGES = [(1, 3), (3, 6)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny("llama", tmp_path_factory.mktemp("wire-llama"))


def _cores(path, dtype=torch.float32):
    return [StageCore(load_layers(path, a, b, dtype), a, b) for a, b in RANGES]


def _pipe(cores, secret="s3cret") -> tuple[OriginWire, list[StageServer]]:
    """Origin → stage 0 → stage 1 → origin, wired as RayStages wires its actors."""
    wire = OriginWire(secret, HOST)
    servers = [StageServer(core, secret, HOST) for core in cores]
    for i, server in enumerate(servers):
        server.connect(servers[i + 1].address if i + 1 < len(servers) else wire.address)
    wire.connect(servers[0].address)
    return wire, servers


def _hop(step: int, first: int, count: int, seq_id: str = "a", width: int = 64) -> Hop:
    torch.manual_seed(step)
    return Hop.single(torch.randn(1, count, width), torch.arange(first, first + count), seq_id,
                      step)


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the pipe did not get there in time"
        time.sleep(0.01)


def test_hops_over_sockets_equal_the_same_layers_in_process(llama):
    wire, _servers = _pipe(_cores(llama))
    local = _cores(llama)
    for step, (first, count) in enumerate([(0, 7), (7, 1), (8, 1), (9, 1)]):
        hop = _hop(step, first, count)
        got = wire.submit(hop, check=False).result(timeout=30)
        want = local[1].forward(local[0].forward(hop))
        assert got.seq_ids == ("a",) and got.step == step and got.lengths == (count,)
        assert torch.equal(got.hidden, want.hidden)
        assert torch.equal(got.positions, hop.positions)
    assert wire.in_flight() == 0


def test_a_micro_batch_of_several_sequences_comes_back_whole(llama):
    wire, servers = _pipe(_cores(llama))
    prefill = Hop(torch.randn(1, 9, 64), torch.cat([torch.arange(5), torch.arange(4)]),
                  ("x", "y"), (5, 4), 0)
    out = wire.submit(prefill.sign(), check=True).result(timeout=30)
    assert out.lengths == (5, 4) and out.hidden.shape == (1, 9, 64)
    assert out.digest == digest(out)  # signed by the last stage, as asked
    assert servers[1].core.cached() == {"x": 5, "y": 4}


def test_bfloat16_activations_cross_bit_for_bit():
    hidden = torch.randn(1, 3, 64).to(torch.bfloat16)
    hop = Hop(hidden, torch.tensor([4, 5, 6]), ("q",), (3,), 9, b"d" * 16, {"z": "why"})
    frames = [bytes(memoryview(f)) for f in hop_frames(hop, "k", check=True)]
    message, back = read_frames(frames, "k")
    assert message.check and back.hidden.dtype == torch.bfloat16
    assert torch.equal(back.hidden, hidden) and back.positions.tolist() == [4, 5, 6]
    assert (back.digest, back.dropped, back.step) == (b"d" * 16, {"z": "why"}, 9)


def test_a_frame_without_the_pipes_secret_or_whole_sizes_is_dropped():
    hop = _hop(0, 0, 2)
    frames = [bytes(memoryview(f)) for f in hop_frames(hop, "other", check=False)]
    assert read_frames(frames, "other") is not None
    assert read_frames(frames, "mine") is None
    assert read_frames([b"other", b"\x00not msgpack"], "other") is None
    assert read_frames(frames[:2], "other") is None  # a hop without its tensors
    assert read_frames([*frames[:2], frames[2][:-4], frames[3]], "other") is None
    assert read_frames([*frames[:3], frames[3] + b"\x00" * 8], "other") is None


def test_a_hop_every_stage_dropped_crosses_empty_with_its_reasons():
    hop = Hop(torch.zeros(1, 0, 64), torch.zeros(0, dtype=torch.long), (), (), 3,
              dropped={"s": "no cache here for position 9"})
    frames = [bytes(memoryview(f)) for f in hop_frames(hop, "k", check=False)]
    _message, back = read_frames(frames, "k")
    assert back.hidden.shape == (1, 0, 64) and back.seq_ids == ()
    assert back.dropped == {"s": "no cache here for position 9"}


def test_a_broken_pipe_fails_submissions_at_once_until_mended(llama):
    wire, _servers = _pipe(_cores(llama))
    wire.fail_all(StageLost("stage 1 is being respawned"))
    with pytest.raises(StageLost, match="respawned"):
        wire.submit(_hop(0, 0, 3), check=False).result(timeout=1)
    assert wire.in_flight() == 0
    wire.mend()
    assert wire.submit(_hop(1, 0, 3), check=False).result(timeout=30).seq_ids == ("a",)


def test_an_intruders_hop_never_reaches_the_layers(llama):
    import zmq

    cores = _cores(llama)
    wire, servers = _pipe(cores)
    intruder = zmq.Context.instance().socket(zmq.PUSH)
    intruder.connect(servers[0].address)
    intruder.send_multipart(hop_frames(_hop(0, 0, 3, "evil"), "guessed", check=False))
    got = wire.submit(_hop(1, 0, 3, "good"), check=False).result(timeout=30)
    assert got.seq_ids == ("good",)
    assert "evil" not in cores[0].cached() and "evil" not in cores[1].cached()
    intruder.close(linger=0)


def test_a_free_follows_the_sequences_hops_through_every_stage(llama):
    cores = _cores(llama)
    wire, _servers = _pipe(cores)
    reply = wire.submit(_hop(0, 0, 6, "gone"), check=False)
    wire.free("gone")  # sent right behind its prefill: freed only after it ran, at each stage
    reply.result(timeout=30)
    _until(lambda: not cores[0].cached() and not cores[1].cached())


def test_a_bad_digest_is_a_cache_mismatch_at_the_origin(llama):
    wire, _servers = _pipe(_cores(llama))
    hop = _hop(0, 0, 3)
    hop.digest = b"\x00" * 16
    with pytest.raises(CacheMismatch, match="digest mismatch"):
        wire.submit(hop, check=True).result(timeout=30)


def test_a_stage_that_raises_fails_its_micro_batch_by_the_errors_name_only(llama):
    cores = _cores(llama)

    def broken(hop, check=False):
        raise ValueError("secret internals")

    cores[1].forward = broken
    wire, _servers = _pipe(cores)
    with pytest.raises(StageFailed) as failed:
        wire.submit(_hop(0, 0, 3), check=False).result(timeout=30)
    assert "ValueError" in str(failed.value) and "internals" not in str(failed.value)
    cores[1].forward = StageCore.forward.__get__(cores[1])  # the next micro-batch goes through
    assert wire.submit(_hop(1, 0, 3, "b"), check=False).result(timeout=30).seq_ids == ("b",)


def test_a_respawned_stage_is_wired_in_and_what_was_lost_fails_at_once(llama):
    cores = _cores(llama)
    wire, servers = _pipe(cores)
    assert wire.submit(_hop(0, 0, 3), check=False).result(timeout=30).seq_ids == ("a",)
    servers[1].connect("tcp://127.0.0.1:9")  # as if the origin's end were gone: no answer
    lost = wire.submit(_hop(1, 3, 1), check=False)
    wire.fail_all(StageLost("stage 1 is gone"))  # what RayStages does when its vigil ends
    with pytest.raises(StageLost):
        lost.result(timeout=5)
    wire.mend()  # what RayStages does once the stages are recovered
    replacement = StageServer(StageCore(load_layers(llama, 3, 6), 3, 6), "s3cret", HOST)
    replacement.connect(wire.address)
    servers[0].connect(replacement.address)
    got = wire.submit(_hop(2, 0, 3, "again"), check=False).result(timeout=30)
    assert got.seq_ids == ("again",) and replacement.core.cached() == {"again": 3}


async def test_a_reply_that_times_out_is_forgotten():
    wire = OriginWire("k", HOST)
    future: Future = Future()
    with wire._lock:
        wire._waiting[5] = future
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await _Reply(wire, 5, future)
    assert wire.in_flight() == 0


class _SocketStages:
    """The Stages protocol over in-process stage servers (RayStages without Ray)."""

    host_hops = True

    def __init__(self, cores):
        self.wire, self.servers = _pipe(cores)
        self.depth = len(cores)

    def submit(self, hop, check):
        return _Reply(self.wire, hop.step, self.wire.submit(hop, check))

    def free(self, seq_id):
        self.wire.free(seq_id)

    async def recover(self, patience=60.0):
        return None

    async def check(self, busy=False):
        return None


async def test_sequences_through_the_scheduler_over_sockets_get_the_unsplit_greedy_tokens(llama):
    from transformers import AutoModelForCausalLM

    stages = _SocketStages(_cores(llama))
    origin = Origin(load_origin(llama, 1), 1, stages, prefill_chunk=4, max_restarts=0,
                    check_digest=True)
    reference = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    prompts = [[5, 9, 2000, 31, 7], [8, 8, 300, 41, 12, 99, 17, 3, 1000, 4, 6], [77, 1]]

    async def run(prompt):
        seq = Sequence(f"s{len(prompt)}", list(prompt))

        def step(logits, _prompt):
            seq.tokens.append(int(torch.argmax(logits)))
            return seq.tokens[-1], len(seq.tokens) - len(prompt) >= 6

        return [token async for token in origin.generate(Job(seq, step))]

    got = await asyncio.gather(*(run(p) for p in prompts))
    for prompt, tokens in zip(prompts, got, strict=True):
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == want
    _until(lambda: not any(s.core.cached() for s in stages.servers))  # released everywhere

"""The vLLM V1 logits-processor hook (engines/vllm/controller_hook.py) against the real runtime
over shared memory, driven with vLLM's own ``BatchUpdate`` and ``SamplingParams`` as the V1
model runner passes them (added / removed / moved rows, live output lists)."""

from __future__ import annotations

import os
import threading
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from engines.controllers.api.base import Controller
from engines.controllers.ipc.channels import MainServer, SideClient, SideServer
from engines.controllers.ipc.shm import BiasMatrix, ChannelObjects
from engines.controllers.runtime.runtime import ControllerRuntime, Limits
from engines.vllm import controller_hook
from engines.vllm.controller_hook import ControllerLogitsProcessor
from tests.controllers import VOCAB, FakeTokenizer, Scripted

STOP = 0  # the fake tokenizer's EOS, listed as the requests' stop token


class _RandomMask(Controller):
    """Allows a fixed random half of the vocabulary, bit 31 and the last token included."""

    WANTED = np.random.default_rng(7).random(VOCAB) < 0.5
    WANTED[[31, 32, VOCAB - 1]] = True

    def mid_process(self):
        return self.WANTED


class _Recording(Controller):
    """Allows token 5 only; says when its mid_process ran."""

    ran = threading.Event()

    def mid_process(self):
        allowed = np.zeros(VOCAB, dtype=bool)
        allowed[5] = True
        _Recording.ran.set()
        return allowed


@pytest.fixture
def runtime():
    prefix = f"/t{os.getpid()}-{uuid.uuid4().hex[:6]}-"
    objects = ChannelObjects(prefix, json_size=1 << 16, bin_size=16 * VOCAB * 4)
    bias = BiasMatrix(prefix, create=False)
    rt = ControllerRuntime(FakeTokenizer(), {"scripted": Scripted, "random": _RandomMask,
                                           "recording": _Recording}, bias,
                           Limits(step_s=1.0))
    main, side_srv = MainServer(prefix), SideServer(prefix)
    threads = [threading.Thread(target=main.serve, args=(rt.handle_main,), daemon=True),
               threading.Thread(target=side_srv.serve, args=(rt.handle_side,), daemon=True)]
    for t in threads:
        t.start()
    side = SideClient(prefix, create=False)

    def instantiate(req_id, arg, module="scripted"):
        assert side.call("instantiate", timeout=5, req_id=req_id, prompt=[1],
                         module_id=module, module_arg=arg) == {}

    yield SimpleNamespace(prefix=prefix, rt=rt, instantiate=instantiate, main=main)
    main.close()
    side_srv.close()
    side.close()
    for t in threads:
        t.join(5)
    rt.close()
    bias.close()
    objects.close()


def _lp(prefix):
    cfg = SimpleNamespace(additional_config={"aici_prefix": prefix} if prefix else {})
    return ControllerLogitsProcessor(cfg, torch.device("cpu"), False)


def _params(seq=None, req_id=None):
    extra = {"aici": {"seq": seq, "req_id": req_id}} if seq is not None else None
    return SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[STOP],
                          extra_args=extra)


def _update(size, added=(), removed=(), moved=()):
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added),
                       moved=list(moved))


def _allowed(row: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(row)).flatten().tolist()


def test_masks_follow_their_rows_and_uncontrolled_rows_are_untouched(runtime):
    runtime.instantiate("run-a", "allow=5")
    runtime.instantiate("run-b", "")
    lp = _lp(runtime.prefix)
    assert lp.is_argmax_invariant() is False
    out_a, out_free, out_b = [], [], []
    lp.update_state(_update(3, added=[(0, _params(1, "run-a"), [1], out_a),
                                      (1, _params(), [1], out_free),
                                      (2, _params(2, "run-b"), [1], out_b)]))
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    out = lp.apply(logits)
    assert _allowed(out[0]) == [5]
    assert torch.equal(out[1], before[1]) and torch.equal(out[2], before[2])
    # A swap moves the mask with its request.
    lp.update_state(_update(3, moved=[(0, 1, MoveDirectionality.SWAP)]))
    out = lp.apply(torch.randn(3, VOCAB))
    assert _allowed(out[1]) == [5] and len(_allowed(out[0])) == VOCAB


def test_tokens_reach_the_controller_and_a_stop_ends_the_row_on_its_stop_token(runtime):
    runtime.instantiate("run-s", "stop-after=2")
    lp = _lp(runtime.prefix)
    out = []
    lp.update_state(_update(1, added=[(0, _params(7, "run-s"), [1], out)]))
    assert len(_allowed(lp.apply(torch.randn(1, VOCAB))[0])) == VOCAB
    out.append(9)  # vLLM appends the sampled token to the live list
    lp.update_state(None)
    assert len(_allowed(lp.apply(torch.randn(1, VOCAB))[0])) == VOCAB
    assert runtime.rt._seqs[7].controller.seen == [9]
    out.append(10)
    lp.update_state(None)
    assert _allowed(lp.apply(torch.randn(1, VOCAB))[0]) == [STOP]
    assert runtime.rt._seqs[7].controller.seen == [9, 10]
    # The row leaves the batch: the runtime hears it as freed on the next step.
    lp.update_state(_update(0, removed=[0]))
    lp.apply(torch.randn(0, VOCAB))
    assert 7 not in runtime.rt._seqs


def test_a_forced_token_or_a_fork_ends_the_row_for_the_frontend_to_resubmit(runtime):
    runtime.instantiate("run-ff", "ff=7,8")
    runtime.instantiate("run-fork", "forks=2")
    runtime.instantiate("run-plain", "allow=3")
    lp = _lp(runtime.prefix)
    lp.update_state(_update(3, added=[(0, _params(1, "run-ff"), [1], []),
                                      (1, _params(2, "run-fork"), [1], []),
                                      (2, _params(3, "run-plain"), [1], [])]))
    out = lp.apply(torch.randn(3, VOCAB))
    assert _allowed(out[0]) == [STOP] and _allowed(out[1]) == [STOP]
    assert _allowed(out[2]) == [3]


def test_without_a_runtime_controlled_rows_end_and_a_dead_runtime_ends_them_too(runtime,
                                                                                monkeypatch):
    lp = _lp(None)
    lp.update_state(_update(2, added=[(0, _params(1, "run-x"), [1], []),
                                      (1, _params(), [1], [])]))
    out = lp.apply(torch.randn(2, VOCAB))
    assert _allowed(out[0]) == [STOP] and len(_allowed(out[1])) == VOCAB
    runtime.instantiate("run-d", "")
    monkeypatch.setattr(controller_hook, "CHANNEL_TIMEOUT_S", 0.3)
    lp = _lp(runtime.prefix)
    runtime.main.close()  # the runtime stops answering
    lp.update_state(_update(1, added=[(0, _params(4, "run-d"), [1], [])]))
    assert _allowed(lp.apply(torch.randn(1, VOCAB))[0]) == [STOP]
    assert "unreachable" in lp._dead


def test_the_step_goes_out_before_the_forward_pass_and_its_answer_masks_the_logits(runtime):
    # The V1 runner calls update_state before the forward pass and apply after it: the
    # runtime's mid_process runs in between (beside the forward pass), not when apply asks.
    runtime.instantiate("run-o", "", module="recording")
    _Recording.ran.clear()
    lp = _lp(runtime.prefix)
    lp.update_state(_update(2, added=[(1, _params(3, "run-o"), [1], [])]))
    assert _Recording.ran.wait(5), "the step was not sent by update_state"
    out = lp.apply(torch.randn(2, VOCAB))
    assert _allowed(out[1]) == [5] and len(_allowed(out[0])) == VOCAB


def test_a_step_that_sampled_nothing_loses_neither_tokens_nor_a_stop(runtime):
    # update_state twice without an apply (vLLM skips sampling when nothing was scheduled):
    # the first answer's stop still ends the row, and no token is reported twice.
    runtime.instantiate("run-n", "stop-after=1")
    lp = _lp(runtime.prefix)
    out = []
    lp.update_state(_update(1, added=[(0, _params(6, "run-n"), [1], out)]))
    assert len(_allowed(lp.apply(torch.randn(1, VOCAB))[0])) == VOCAB
    out.append(9)
    lp.update_state(None)  # reports 9: the controller stops
    lp.update_state(None)  # no apply came between
    assert _allowed(lp.apply(torch.randn(1, VOCAB))[0]) == [STOP]
    assert runtime.rt._seqs[6].controller.seen == [9]


def test_a_preempted_request_resumed_later_is_bound_again_and_reports_no_token_twice(runtime):
    # vLLM removes a preempted request from the batch and re-adds it later with the same
    # output list: its controller goes on from where it was.
    runtime.instantiate("run-p", "")
    lp = _lp(runtime.prefix)
    out = []
    lp.update_state(_update(1, added=[(0, _params(8, "run-p"), [1], out)]))
    lp.apply(torch.randn(1, VOCAB))
    out.append(9)
    lp.update_state(None)
    lp.apply(torch.randn(1, VOCAB))
    lp.update_state(_update(0, removed=[0]))  # preempted
    lp.apply(torch.randn(0, VOCAB))
    lp.update_state(_update(1, added=[(0, _params(8, "run-p"), [1], out)]))  # resumed
    assert len(_allowed(lp.apply(torch.randn(1, VOCAB))[0])) == VOCAB  # not ended
    out.append(10)
    lp.update_state(None)
    assert len(_allowed(lp.apply(torch.randn(1, VOCAB))[0])) == VOCAB
    assert runtime.rt._seqs[8].controller.seen == [9, 10]


def test_with_a_placeholder_token_the_step_waits_for_apply(runtime):
    # Async scheduling puts -1 where the last token will be; it is known in apply().
    runtime.instantiate("run-a", "", module="recording")
    _Recording.ran.clear()
    lp = _lp(runtime.prefix)
    out = [-1]
    lp.update_state(_update(1, added=[(0, _params(2, "run-a"), [1], out)]))
    assert not lp._main.waiting  # nothing sent before the forward pass
    out[0] = 7
    assert _allowed(lp.apply(torch.randn(1, VOCAB))[0]) == [5]
    assert _Recording.ran.is_set()


def test_malformed_controller_args_are_refused_at_admission():
    for extra in ({"aici": {"seq": "1", "req_id": "r"}}, {"aici": [1]}):
        with pytest.raises(ValueError, match="extra_args"):
            ControllerLogitsProcessor.validate_params(
                SamplingParams(ignore_eos=True, stop_token_ids=[STOP], extra_args=extra))
    ControllerLogitsProcessor.validate_params(SamplingParams())  # no controller: nothing to say



def test_a_bitmask_becomes_exactly_its_allowed_tokens_and_leaves_their_logits_alone(runtime):
    """Every bit position (bit 31 of a word, the last word) against the controller's own
    boolean mask; a logits row wider than the vocabulary loses its tail."""
    runtime.instantiate("run-r", "", module="random")
    lp = _lp(runtime.prefix)
    lp.update_state(_update(2, added=[(1, _params(9, "run-r"), [1], [])]))
    logits = torch.randn(2, VOCAB + 7)
    before = logits.clone()
    out = lp.apply(logits)
    wanted = torch.from_numpy(_RandomMask.WANTED)
    assert _allowed(out[1]) == torch.nonzero(wanted).flatten().tolist()
    assert torch.equal(out[1, :VOCAB][wanted], before[1, :VOCAB][wanted])
    assert torch.equal(out[0], before[0])


# --- Model Runner V2 (vLLM's GPU default): the same class, driven through MRV2's interface ---

HOOK = "engines.vllm.controller_hook:ControllerLogitsProcessor"


def test_both_of_vllms_loaders_accept_the_one_hook_name():
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

    assert _load_logitsprocs_by_fqcns([HOOK]) == [ControllerLogitsProcessor]
    assert _load_v2_logitsprocs_by_fqcns([HOOK]) == [ControllerLogitsProcessor]


class _MRV2:
    """What MRV2 hands a logits processor: request slots, and per step vLLM's own
    ``LogitsContext`` (batch row → slot, the token each row feeds and its position)."""

    def __init__(self, prefix, max_reqs=4):
        self.prompt_len = np.zeros(max_reqs, dtype=np.int32)
        req_states = SimpleNamespace(prompt_len=SimpleNamespace(np=self.prompt_len))
        cfg = SimpleNamespace(additional_config={"aici_prefix": prefix})
        self.lp = ControllerLogitsProcessor(cfg, req_states)

    def add(self, slot, params, prompt_len):
        self.prompt_len[slot] = prompt_len
        return self.lp.add_request(slot, params)

    def step(self, batch, extra_rows=0):
        """``batch``: (slot, fed token, position) per row, in row order."""
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

        slots = [s for s, _, _ in batch]
        rows = torch.tensor(slots + slots[:extra_rows], dtype=torch.int32)
        ctx = LogitsContext(
            expanded_idx_mapping=rows, idx_mapping=torch.tensor(slots, dtype=torch.int32),
            idx_mapping_np=np.array(slots, dtype=np.int32),
            expanded_local_pos=torch.zeros(len(rows), dtype=torch.int32),
            input_ids=torch.tensor([t for _, t, _ in batch] + [0] * extra_rows),
            pos=torch.tensor([p for _, _, p in batch] + [0] * extra_rows),
            seq_lens_upper_bound_np=np.array([p + 1 for _, _, p in batch]))
        return self.lp.apply(torch.randn(len(rows), VOCAB), ctx)


def test_under_mrv2_fed_tokens_reach_the_controller_and_masks_follow_the_slots(runtime):
    runtime.instantiate("run-v2", "stop-after=2")
    runtime.instantiate("run-m", "allow=5")
    mr = _MRV2(runtime.prefix)
    assert mr.add(2, _params(7, "run-v2"), prompt_len=3) is True
    assert mr.add(0, _params(), prompt_len=3) is False  # not controlled: MRV2 may skip it
    assert mr.add(1, _params(8, "run-m"), prompt_len=2) is True
    # first step: every row feeds its last prompt token (no output yet)
    out = mr.step([(0, 4, 2), (2, 4, 2), (1, 4, 1)])
    assert len(_allowed(out[1])) == VOCAB and _allowed(out[2]) == [5]
    assert runtime.rt._seqs[7].controller.seen == []
    # rows reordered; each feeds the token it sampled last step
    out = mr.step([(1, 5, 2), (2, 9, 3), (0, 6, 3)])
    assert _allowed(out[0]) == [5] and len(_allowed(out[2])) == VOCAB
    assert runtime.rt._seqs[7].controller.seen == [9]
    out = mr.step([(2, 10, 4), (1, 5, 3)])
    assert _allowed(out[0]) == [STOP]  # stopped after 2 tokens: its row ends on its stop
    assert runtime.rt._seqs[7].controller.seen == [9, 10]
    # the slot is reused: its previous request is reported freed
    runtime.instantiate("run-next", "")
    mr.add(2, _params(11, "run-next"), prompt_len=5)
    mr.step([(2, 1, 4)])
    assert 7 not in runtime.rt._seqs and 11 in runtime.rt._seqs


def test_under_mrv2_speculative_rows_end_the_controlled_requests(runtime):
    runtime.instantiate("run-sd", "allow=5")
    mr = _MRV2(runtime.prefix)
    mr.add(1, _params(3, "run-sd"), prompt_len=2)
    mr.add(0, _params(), prompt_len=2)
    out = mr.step([(0, 4, 1), (1, 4, 1)], extra_rows=2)  # one draft row per request
    assert _allowed(out[1]) == [STOP] and _allowed(out[3]) == [STOP]
    assert len(_allowed(out[0])) == VOCAB

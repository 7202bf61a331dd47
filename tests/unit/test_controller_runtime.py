"""The controller runtime (engines/controllers/runtime/runtime.py): the seed's commands against scripted
controllers, llguidance's, and over the shared-memory transport.

Shapes are checked against aicirt's documented examples (``docs/protocols/controller-runtime.md``):
``SequenceResult`` = ``error``, ``result``, ``storage``, ``logs``, ``micros``; sequence ids as
strings; ``pre`` results ``suspend`` / ``num_forks`` / ``ff_tokens``; ``post`` results ``stop``.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import numpy as np
import pytest

from engines.controllers.api.base import Controller
from engines.controllers.ipc.channels import MainClient, MainServer, SideClient, SideServer
from engines.controllers.ipc.shm import BiasMatrix
from engines.controllers.runtime.runtime import ControllerRuntime, Limits, module_id_of
from tests.controllers import VOCAB, FakeTokenizer, Scripted, WireRuntime


def _runtime(bias=None, **limits):
    return WireRuntime(FakeTokenizer(), {"scripted": Scripted, "plain": Controller}, bias,
                             Limits(**limits))


def _side(rt, request):
    got = []
    done = threading.Event()
    rt.handle_side(request, lambda answer: (got.append(answer), done.set()))
    assert done.wait(5), "the side request was never answered"
    return got[0]


def _instantiate(rt, req_id, arg, module="scripted"):
    answer = _side(rt, {"op": "instantiate", "$rid": "r", "req_id": req_id, "prompt": [1],
                        "module_id": module, "module_arg": arg})
    assert answer["type"] == "ok", answer
    return answer


def _step(rt, **cmd):
    answer = rt.handle_main({"op": "post_pre_process", "post_ops": [], "pre_ops": [],
                             "freed": [], **cmd})
    assert answer["type"] == "ok"
    return answer["data"]


def _is_record(rec):
    return set(rec) == {"error", "result", "storage", "logs", "micros"}


def test_ping_tokens_and_unknown_ops():
    rt = _runtime()
    assert rt.handle_main({"op": "ping"}) == {"type": "ok", "data": {"pong": 1}}
    assert rt.handle_main({"op": "tokens"}) == {"type": "ok", "data": {"vocab_size": VOCAB}}
    bad = rt.handle_main({"op": "frobnicate"})
    assert bad["type"] == "error" and bad["is_user_error"]


def test_tags_list_set_and_the_non_admin_prefix_rule():
    rt = _runtime()
    tags = _side(rt, {"op": "get_tags", "$rid": "a"})["data"]["tags"]
    assert {t["tag"] for t in tags} == {"scripted", "plain"}
    assert all(set(t) == {"tag", "module_id", "updated_at", "updated_by", "wasm_size",
                          "compiled_size"} for t in tags)
    mod = module_id_of(Scripted)
    assert len(mod) == 64 and int(mod, 16) >= 0
    admin = {"user": "root", "is_admin": True}
    alice = {"user": "alice", "is_admin": False}
    ok = _side(rt, {"op": "set_tags", "$auth": admin, "module_id": mod, "tags": ["mine"]})
    assert ok["data"]["tags"][0]["updated_by"] == "root"
    denied = _side(rt, {"op": "set_tags", "$auth": alice, "module_id": mod, "tags": ["x"]})
    assert denied["type"] == "error" and "permission denied" in denied["error"]
    allowed = _side(rt, {"op": "set_tags", "$auth": alice, "module_id": mod,
                         "tags": ["alice.x"]})
    assert allowed["type"] == "ok"
    for bad_tags in (["has space"], ["a" * 51], ["deadbeef" * 4], [], "notalist"):
        answer = _side(rt, {"op": "set_tags", "$auth": admin, "module_id": mod,
                            "tags": bad_tags})
        assert answer["type"] == "error" and answer["is_user_error"], bad_tags
    unknown = _side(rt, {"op": "set_tags", "$auth": admin, "module_id": "0" * 64,
                         "tags": ["t"]})
    assert "unknown module_id" in unknown["error"]
    newest = _side(rt, {"op": "get_tags"})["data"]["tags"]
    assert [t["updated_at"] for t in newest] == sorted((t["updated_at"] for t in newest),
                                                      reverse=True)
    assert {"mine", "alice.x"} <= {t["tag"] for t in newest}
    # The instance runs under the new tag too.
    _instantiate(rt, "run-tagged", "", module="alice.x")
    wasm = _side(rt, {"op": "mk_module", "binary": "AGFzbQ=="})
    assert wasm["type"] == "error" and "not supported" in wasm["error"]


def test_instantiate_errors_are_user_errors_in_the_side_answer():
    rt = _runtime(max_arg_bytes=100)
    cases = {
        "unknown": {"module_id": "nope"},
        "program": {"module_id": "scripted", "module_arg": "bad=1"},
        "size": {"module_id": "scripted", "module_arg": "x" * 101},
        "req_id": {"module_id": "scripted", "req_id": ""},
    }
    for name, fields in cases.items():
        answer = _side(rt, {"op": "instantiate", "req_id": f"run-{name}", "prompt": [1],
                            **fields})
        assert answer["type"] == "error" and answer["is_user_error"], name
    assert "known: plain, scripted" in _side(rt, {"op": "instantiate", "req_id": "r",
                                                  "module_id": "nope"})["error"]
    _instantiate(rt, "run-dup", "")
    dup = _side(rt, {"op": "instantiate", "req_id": "run-dup", "module_id": "scripted"})
    assert "already instantiated" in dup["error"]


def test_a_sequence_binds_forces_tokens_stops_and_is_freed():
    rt = _runtime()
    _instantiate(rt, "run-1", "ff=7,8 stop-after=3")
    data = _step(rt, pre_ops=[{"id": 2, "req_id": "run-1"}])
    assert data["post_seqs"] == {}
    rec = data["pre_seqs"]["2"]
    assert _is_record(rec) and rec["error"] == ""
    assert rec["result"] == {"suspend": False, "num_forks": 1, "ff_tokens": [7, 8]}
    data = _step(rt, post_ops=[{"id": 2, "tokens": [7, 8], "backtrack": 0}])
    assert data["post_seqs"]["2"]["result"] == {"stop": False}
    assert data["pre_seqs"]["2"]["result"]["ff_tokens"] == []
    data = _step(rt, post_ops=[{"id": 2, "tokens": [9], "backtrack": 0}])
    assert data["post_seqs"]["2"]["result"] == {"stop": True}
    assert "2" not in data["pre_seqs"]  # stopped: the engine frees it next
    data = _step(rt, freed=[2])
    assert data == {"post_seqs": {}, "pre_seqs": {}}
    missing = _step(rt, post_ops=[{"id": 2, "tokens": [1], "backtrack": 0}])
    assert "unknown sequence 2" in missing["post_seqs"]["2"]["error"]
    unbound = _step(rt, pre_ops=[{"id": 3, "req_id": "run-never"}])
    assert "no instantiated controller" in unbound["pre_seqs"]["3"]["error"]


def test_bias_rows_follow_the_order_of_mid_process_ops():
    prefix = f"/t{os.getpid()}-{uuid.uuid4().hex[:6]}-"
    bias = BiasMatrix(prefix, size=8 * VOCAB * 4, create=True)
    try:
        rt = _runtime(bias)
        for i, allow in enumerate((5, 11, 42)):
            _instantiate(rt, f"run-{i}", f"allow={allow}")
        _instantiate(rt, "run-free", "")
        _step(rt, pre_ops=[{"id": 10 + i, "req_id": f"run-{i}"} for i in range(3)]
              + [{"id": 20, "req_id": "run-free"}])
        order = [12, 20, 10, 11]
        answer = rt.handle_main({"op": "mid_process",
                                 "ops": [{"id": i, "clone_id": None} for i in order]})
        assert answer["type"] == "ok"
        data = answer["data"]
        assert data["num_seqs"] == 4 and set(data["seqs"]) == {"10", "11", "12", "20"}
        assert all(_is_record(r) and r["result"] is None for r in data["seqs"].values())
        rows = bias.rows(4, VOCAB)
        assert int(np.argmax(rows[0])) == 42 and np.isneginf(rows[0]).sum() == VOCAB - 1
        assert (rows[1] == 0).all()  # no constraint: every token allowed
        assert int(np.argmax(rows[2])) == 5 and int(np.argmax(rows[3])) == 11
        del rows
    finally:
        bias.close()


def test_step_is_post_pre_and_mid_in_one_round_trip_without_masks_for_rows_it_ends():
    prefix = f"/t{os.getpid()}-{uuid.uuid4().hex[:6]}-"
    bias = BiasMatrix(prefix, size=8 * VOCAB * 4, create=True)
    try:
        rt = _runtime(bias)
        _instantiate(rt, "run-a", "allow=5")
        _instantiate(rt, "run-b", "ff=7,8")  # forces tokens first: ended this step
        _instantiate(rt, "run-c", "allow=9 stop-after=1")
        mid_ops = [{"id": i, "clone_id": None} for i in (3, 1, 2)]
        answer = rt.handle_main({"op": "step", "post_ops": [], "freed": [], "mid_ops": mid_ops,
                                 "pre_ops": [{"id": 1, "req_id": "run-a"},
                                             {"id": 2, "req_id": "run-b"},
                                             {"id": 3, "req_id": "run-c"}]})
        assert answer["type"] == "ok"
        data = answer["data"]
        assert data["pre_seqs"]["2"]["result"]["ff_tokens"] == [7, 8]
        assert data["mid"]["ids"] == [3, 1] and data["mid"]["num_seqs"] == 2
        rows = bias.rows(2, VOCAB)
        assert int(np.argmax(rows[0])) == 9 and int(np.argmax(rows[1])) == 5
        del rows
        # the next step reports c's token: its controller stops, so c gets no mask
        answer = rt.handle_main({"op": "step", "pre_ops": [], "freed": [],
                                 "post_ops": [{"id": 3, "tokens": [9], "backtrack": 0}],
                                 "mid_ops": [{"id": 1, "clone_id": None},
                                             {"id": 3, "clone_id": None}]})
        data = answer["data"]
        assert data["post_seqs"]["3"]["result"] == {"stop": True}
        assert data["mid"]["ids"] == [1]
        # beyond the seed: bitmasks instead of dense rows when the engine asks for them
        _instantiate(rt, "run-d", "")
        answer = rt.handle_main({"op": "step", "post_ops": [], "freed": [],
                                 "pre_ops": [{"id": 4, "req_id": "run-d"}],
                                 "mask_format": "bits",
                                 "mid_ops": [{"id": 4, "clone_id": None},
                                             {"id": 1, "clone_id": None}]})
        assert answer["data"]["mid"]["ids"] == [4, 1]
        assert answer["data"]["mid"]["unmasked"] == [0]
        words = bias.words(2, VOCAB)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(2, -1)
        assert bits[0].all()  # unconstrained: every id allowed
        assert np.flatnonzero(bits[1]).tolist() == [5]
        del words
    finally:
        bias.close()


def test_a_slow_mid_process_is_a_logged_no_op_then_fails_the_sequence_others_go_on():
    prefix = f"/t{os.getpid()}-{uuid.uuid4().hex[:6]}-"
    bias = BiasMatrix(prefix, size=4 * VOCAB * 4, create=True)
    try:
        # A controller that blocks uses no CPU: the wall cap (2 x 0.1 s here) cuts it.
        rt = _runtime(bias, step_s=0.1, wall_factor=2.0, max_timeout_steps=3)
        _instantiate(rt, "run-slow", "slow-mid=0.5 allow=3")
        _instantiate(rt, "run-fast", "allow=9")
        _step(rt, pre_ops=[{"id": 1, "req_id": "run-slow"}, {"id": 2, "req_id": "run-fast"}])
        errors = []
        for _ in range(3):
            t0 = time.monotonic()
            data = rt.handle_main({"op": "mid_process", "ops": [{"id": 1}, {"id": 2}]})["data"]
            assert time.monotonic() - t0 < 0.4  # bounded by the wall cap, not the controller
            rows = bias.rows(2, VOCAB)
            assert (rows[0] == 0).all()  # the slow one: unconstrained this step
            assert int(np.argmax(rows[1])) == 9 and np.isneginf(rows[1]).sum() == VOCAB - 1
            del rows
            assert data["seqs"]["2"]["error"] == ""
            errors.append(data["seqs"]["1"]["error"])
            time.sleep(0.6)  # let the overrunning call finish before the next step
        assert errors[:2] == ["", ""]
        assert "3 steps in a row" in errors[2]
        # Each cut call counted by its kind, for the replica's metrics.
        stats = _side(rt, {"op": "get_stats", "$rid": "s"})["data"]
        assert stats["timeouts"] == {"mid": 3, "pre_post": 0}
    finally:
        bias.close()


def test_the_step_bound_is_a_controllers_own_cpu_time_not_its_wait_for_the_others():
    # Four controllers that each compute 60 ms share one process and its GIL: the step takes
    # ~240 ms of wall time, but none used its 100 ms of CPU; one that computes 1 s is cut
    # once it used its 100 ms, long before the wall cap.
    rt = _runtime(step_s=0.1, wall_factor=20.0)
    for i in range(4):
        _instantiate(rt, f"run-{i}", "busy-mid=0.06")
    _instantiate(rt, "run-hog", "busy-mid=1.0")
    _step(rt, pre_ops=[{"id": i, "req_id": f"run-{i}"} for i in range(4)]
          + [{"id": 9, "req_id": "run-hog"}])
    t0 = time.monotonic()
    data = rt.handle_main({"op": "mid_process",
                           "ops": [{"id": i} for i in range(4)] + [{"id": 9}]})["data"]
    assert time.monotonic() - t0 < 1.0  # the hog was not waited for
    assert [data["seqs"][str(i)]["error"] for i in range(4)] == [""] * 4
    assert all(data["seqs"][str(i)]["logs"] == "" for i in range(4))  # no timeout logged
    assert "timeout: mid_process over 100 ms" in data["seqs"]["9"]["logs"]
    time.sleep(1.2)  # the hog's call finishes before the runtime closes
    rt.close()


def test_a_slow_post_process_or_a_raising_controller_fails_only_its_sequence():
    rt = _runtime(step_s=0.2, wall_factor=2.0)  # a blocking call is cut at 0.4 s
    _instantiate(rt, "run-slow", "slow-post=0.5")
    _instantiate(rt, "run-bug", "raise-mid")
    _instantiate(rt, "run-ok", "")
    _step(rt, pre_ops=[{"id": i, "req_id": r} for i, r in
                       ((1, "run-slow"), (2, "run-bug"), (3, "run-ok"))])
    mid = rt.handle_main({"op": "mid_process", "ops": [{"id": 1}, {"id": 2}, {"id": 3}]})
    assert "RuntimeError: controller bug" in mid["data"]["seqs"]["2"]["error"]
    data = _step(rt, post_ops=[{"id": i, "tokens": [4], "backtrack": 0} for i in (1, 3)])
    assert "longer than 200 ms" in data["post_seqs"]["1"]["error"]
    assert data["post_seqs"]["3"]["result"] == {"stop": False}
    assert set(data["pre_seqs"]) == {"3"}  # failed sequences are not asked again
    stats = _side(rt, {"op": "get_stats", "$rid": "s"})["data"]
    assert stats["timeouts"] == {"mid": 0, "pre_post": 1}
    assert sum(stats["step"]["counts"]) == 2 and stats["step"]["total"] > 0.3  # one cut at 0.4 s
    assert stats["live"] == 3  # instantiated, never released
    rt.close()


def test_forks_share_variables_reported_as_write_var_storage_and_are_bounded():
    rt = _runtime(max_forks=3)
    _instantiate(rt, "run-f", "forks=2 var=out")
    data = _step(rt, pre_ops=[{"id": 1, "req_id": "run-f"}])
    assert data["pre_seqs"]["1"]["result"]["num_forks"] == 2
    mid = rt.handle_main({"op": "mid_process", "ops": [{"id": 1}, {"id": 5, "clone_id": 1}]})
    assert set(mid["data"]["seqs"]) == {"1", "5"}
    data = _step(rt, post_ops=[{"id": 1, "tokens": [65 % VOCAB], "backtrack": 0},
                               {"id": 5, "tokens": [66 % VOCAB], "backtrack": 0}])
    first = data["post_seqs"]["1"]
    assert first["storage"] == [{"WriteVar": {"name": "out", "value": bytes([1]).hex(),
                                              "op": "Append", "when_version_is": None}}]
    assert first["logs"] == "wrote [1]\n"
    assert data["post_seqs"]["5"]["storage"][0]["WriteVar"]["value"] == "02"
    # Both forks wrote the one variable of their request; the fork asks for no more forks.
    assert sorted(rt._seqs[1].ctx.get_var("out")) == [1, 2]
    assert data["pre_seqs"]["5"]["result"]["num_forks"] == 1
    _instantiate(rt, "run-many", "forks=4")
    over = _step(rt, pre_ops=[{"id": 9, "req_id": "run-many"}])
    assert "exceed the limit of 3" in over["pre_seqs"]["9"]["error"]


def test_instantiate_that_overruns_its_bound_is_answered_and_not_kept():
    class Slow(Controller):
        def __init__(self, ctx, arg, prompt):
            time.sleep(1.0)
            super().__init__(ctx, arg, prompt)

    rt = WireRuntime(FakeTokenizer(), {"slow": Slow}, limits=Limits(init_s=0.05))
    t0 = time.monotonic()
    answer = _side(rt, {"op": "instantiate", "req_id": "run-s", "module_id": "slow"})
    assert time.monotonic() - t0 < 0.6
    assert "initialization took longer than 50 ms" in answer["error"]
    time.sleep(1.2)
    assert rt._live == {}


# --- llguidance, with the embedded model's real tokenizer ----------------------------------

@pytest.fixture(scope="module")
def hf_tokenizer_info():
    from engines.controllers.runtime.builtin import HFTokenizerInfo
    from engines.kit.embedded import prepare_embedded_model
    info = HFTokenizerInfo.from_pretrained(str(prepare_embedded_model(progress=False)))
    assert info.llg.vocab_size == info.vocab_size  # built once, as the runtime's start does
    return info


def test_llguidance_masks_digits_fast_forwards_literals_and_stops(hf_tokenizer_info):
    from engines.controllers.runtime.builtin import BUILTIN_CONTROLLERS
    tok = hf_tokenizer_info
    # A generous step bound: the first masks of a grammar are the slowest, and CI is busy.
    rt = WireRuntime(tok, BUILTIN_CONTROLLERS, limits=Limits(step_s=2.0, init_s=10.0))
    grammar = {"grammars": [{"lark_grammar": 'start: "The answer is " /[0-9]{2}/'}]}
    _instantiate(rt, "run-g", {"grammar": grammar}, module="llguidance")
    data = _step(rt, pre_ops=[{"id": 1, "req_id": "run-g"}])
    ff = data["pre_seqs"]["1"]["result"]["ff_tokens"]
    assert tok.decode(ff).decode().startswith("The answer is")
    _step(rt, post_ops=[{"id": 1, "tokens": ff, "backtrack": 0}])
    allowed = rt._seqs[1].controller.mid_process()
    bits = np.unpackbits(allowed.view(np.uint8), bitorder="little")[:tok.vocab_size]
    texts = {tok.decode([int(t)]).decode("utf-8", "replace") for t in np.flatnonzero(bits)}
    assert texts and all(t.strip().isdigit() for t in texts), sorted(texts)[:10]
    stopped = []
    for digit in "42":
        data = _step(rt, post_ops=[{"id": 1, "tokens": tok.encode(digit), "backtrack": 0}])
        stopped.append(data["post_seqs"]["1"]["result"]["stop"])
    assert stopped == [False, True]
    # A token the grammar does not allow fails the sequence with llguidance's message.
    _instantiate(rt, "run-h", {"grammar": grammar}, module="llguidance")
    _step(rt, pre_ops=[{"id": 2, "req_id": "run-h"}])
    bad = _step(rt, post_ops=[{"id": 2, "tokens": tok.encode("Nope"), "backtrack": 0}])
    assert bad["post_seqs"]["2"]["error"].startswith("llguidance:")


def test_llguidance_refuses_bad_grammars_at_instantiate(hf_tokenizer_info):
    from engines.controllers.runtime.builtin import BUILTIN_CONTROLLERS
    rt = WireRuntime(hf_tokenizer_info, BUILTIN_CONTROLLERS, limits=Limits(init_s=10.0))
    for arg in ("not json", '{"nogrammar": 1}',
                {"grammar": {"grammars": [{"lark_grammar": "start: /[0-9/"}]}}):
        answer = _side(rt, {"op": "instantiate", "req_id": f"run-{uuid.uuid4().hex}",
                            "module_id": "llguidance", "module_arg": arg})
        assert answer["type"] == "error" and answer["is_user_error"], arg
        assert answer["error"].startswith("llguidance:"), answer["error"]


def test_llguidance_forks_are_independent(hf_tokenizer_info):
    from engines.controllers.api.base import ControllerContext, Variables
    from engines.controllers.runtime.builtin import GuidanceController
    tok = hf_tokenizer_info
    arg = '{"grammar": {"grammars": [{"lark_grammar": "start: \\"a\\" | \\"b\\" \\"c\\""}]}}'
    ctx = ControllerContext(tok, Variables())
    ctl = GuidanceController(ctx, arg, [])
    twin = ctl.fork(ctx.forked())
    assert ctl.post_process(tok.encode("a"), 0) is True
    assert twin.post_process(tok.encode("b"), 0) is False  # still needs "c"


# --- over shared memory, both ends ---------------------------------------------------------

def test_the_runtime_over_shared_memory_answers_the_engine_end():
    prefix = f"/t{os.getpid()}-{uuid.uuid4().hex[:6]}-"
    bias = BiasMatrix(prefix, size=4 * VOCAB * 4, create=True)
    main, side = MainClient(prefix, size=1 << 16), SideClient(prefix, size=1 << 16)
    runtime_bias = BiasMatrix(prefix, create=False)
    rt = ControllerRuntime(FakeTokenizer(), {"scripted": Scripted}, runtime_bias, Limits())
    main_srv, side_srv = MainServer(prefix), SideServer(prefix)
    threads = [threading.Thread(target=main_srv.serve, args=(rt.handle_main,)),
               threading.Thread(target=side_srv.serve, args=(rt.handle_side,))]
    for t in threads:
        t.start()
    try:
        assert main.call("tokens", timeout=5) == {"vocab_size": VOCAB}
        auth = {"user": "localhost", "is_admin": True}
        assert side.call("instantiate", auth, timeout=5, req_id="run-x", prompt=[1],
                         module_id="scripted", module_arg="allow=17") == {}
        data = main.call("post_pre_process", timeout=5, post_ops=[],
                         pre_ops=[{"id": 4, "req_id": "run-x"}], freed=[])
        assert data["pre_seqs"]["4"]["result"]["num_forks"] == 1
        data = main.call("mid_process", timeout=5, ops=[{"id": 4, "clone_id": None}])
        assert data["num_seqs"] == 1
        row = bias.rows(1, VOCAB)[0]
        assert int(np.argmax(row)) == 17 and np.isneginf(row).sum() == VOCAB - 1
        del row
    finally:
        main_srv.close()
        side_srv.close()
        for t in threads:
            t.join(5)
        rt.close()
        runtime_bias.close()
        side.close()
        main.close()
        bias.close()


# --- between segments: advance and release (the frontend driver's side ops) ---------------

class Counting(Scripted):
    """Scripted, counting its pre_process calls (each must follow a post_process once)."""

    pres = 0

    def pre_process(self):
        Counting.pres += 1
        return super().pre_process()


def _advance(rt, req_id, tokens=()):
    answer = _side(rt, {"op": "advance", "$rid": "a", "req_id": req_id, "tokens": list(tokens)})
    assert answer["type"] == "ok", answer
    return answer["data"]


def test_advance_runs_the_pre_process_owed_once_and_reports_it_until_the_next_post():
    Counting.pres = 0
    rt = WireRuntime(FakeTokenizer(), {"counting": Counting}, None, Limits())
    _instantiate(rt, "run-a", "ff=5,6 var=v", module="counting")
    first = _advance(rt, "run-a")
    assert first["pre"] == {"suspend": False, "num_forks": 1, "ff_tokens": [5, 6]}
    assert first["stop"] is False and first["error"] == ""
    assert _advance(rt, "run-a")["pre"] == first["pre"] and Counting.pres == 1
    after = _advance(rt, "run-a", [5, 6])  # the forced tokens, appended by the frontend
    assert after["pre"] == {"suspend": False, "num_forks": 1, "ff_tokens": []}
    assert Counting.pres == 2
    assert after["storage"][0]["WriteVar"]["value"] == bytes([5, 6]).hex()
    # The segment that follows binds it: its pre_process was already run, so not again.
    data = _step(rt, pre_ops=[{"id": 3, "req_id": "run-a"}])
    assert "3" not in data["pre_seqs"] and Counting.pres == 2
    data = _step(rt, post_ops=[{"id": 3, "tokens": [9], "backtrack": 0}])
    assert data["post_seqs"]["3"]["result"] == {"stop": False}
    assert data["pre_seqs"]["3"]["result"]["ff_tokens"] == [] and Counting.pres == 3


def test_advance_takes_a_controller_away_from_the_engine_even_before_its_freed_notice():
    Counting.pres = 0
    rt = WireRuntime(FakeTokenizer(), {"counting": Counting}, None, Limits())
    _instantiate(rt, "run-b", "", module="counting")
    _step(rt, pre_ops=[{"id": 7, "req_id": "run-b"}])
    assert Counting.pres == 1
    # The segment ended in the engine; the frontend reports its last token first.
    state = _advance(rt, "run-b", [4])
    assert state["pre"]["ff_tokens"] == [] and Counting.pres == 2
    # A late step still names sequence 7: it is no longer this controller's.
    data = _step(rt, post_ops=[{"id": 7, "tokens": [1], "backtrack": 0}], freed=[7])
    assert "unknown sequence 7" in data["post_seqs"]["7"]["error"] and Counting.pres == 2
    # ... and a new segment binds it under a new id.
    data = _step(rt, pre_ops=[{"id": 8, "req_id": "run-b"}])
    assert "8" not in data["pre_seqs"]  # pre already run by advance


def test_advance_reports_stop_and_failures_and_release_forgets_the_controller():
    rt = _runtime()
    _instantiate(rt, "run-s", "stop-after=2")
    assert _advance(rt, "run-s", [1])["stop"] is False
    stopped = _advance(rt, "run-s", [2])
    assert stopped["stop"] is True and stopped["pre"] is None
    _instantiate(rt, "run-f", "raise-mid")
    _step(rt, pre_ops=[{"id": 1, "req_id": "run-f"}])
    mid = rt.handle_main({"op": "mid_process", "ops": [{"id": 1, "clone_id": None}]})
    assert "controller bug" in mid["data"]["seqs"]["1"]["error"]
    assert "controller bug" in _advance(rt, "run-f")["error"]
    assert _side(rt, {"op": "release", "$rid": "x", "req_id": "run-s"})["data"] == \
        {"released": True}
    gone = _side(rt, {"op": "advance", "$rid": "y", "req_id": "run-s"})
    assert gone["type"] == "error" and "no controller" in gone["error"]
    bad = _side(rt, {"op": "advance", "$rid": "z", "req_id": "run-f", "tokens": ["a"]})
    assert bad["type"] == "error" and bad["is_user_error"]


def test_instantiate_with_advance_answers_the_first_pre_process_in_the_same_round_trip():
    Counting.pres = 0
    rt = WireRuntime(FakeTokenizer(), {"counting": Counting}, None, Limits())
    answer = _side(rt, {"op": "instantiate", "$rid": "r", "req_id": "run-x", "prompt": [1],
                        "module_id": "counting", "module_arg": "ff=5", "advance": True})
    assert answer["type"] == "ok", answer
    assert answer["data"]["pre"]["ff_tokens"] == [5] and answer["data"]["stop"] is False
    assert Counting.pres == 1
    assert _advance(rt, "run-x")["pre"]["ff_tokens"] == [5] and Counting.pres == 1  # owed once
    bad = _side(rt, {"op": "instantiate", "$rid": "r", "req_id": "run-y", "prompt": [1],
                     "module_id": "nope", "module_arg": "", "advance": True})
    assert bad["type"] == "error" and "unknown controller" in bad["error"]


# --- forks run by the frontend: the fork side op, suspend between segments ------------------

def _fork(rt, req_id, into):
    return _side(rt, {"op": "fork", "$rid": "f", "req_id": req_id, "into": list(into)})


def test_fork_copies_the_controller_under_new_req_ids_that_share_its_variables():
    rt = _runtime(max_forks=3)
    _instantiate(rt, "run-p", "forks=3 var=v branch-ff")
    assert _advance(rt, "run-p")["pre"]["num_forks"] == 3
    answer = _fork(rt, "run-p", ["run-p.1", "run-p.2"])
    assert answer["type"] == "ok" and answer["data"] == {"forks": ["run-p.1", "run-p.2"]}
    # every branch knows which it is and owes a pre_process: branch i forces 100 + i
    for i, req_id in enumerate(["run-p", "run-p.1", "run-p.2"]):
        assert _advance(rt, req_id)["pre"]["ff_tokens"] == [100 + i]
    _advance(rt, "run-p.1", [7])
    assert rt._live["run-p"].ctx.get_var("v") == bytes([7])  # one variable store per request
    assert rt._live["run-p"].family == {"run-p", "run-p.1", "run-p.2"}
    _side(rt, {"op": "release", "$rid": "r", "req_id": "run-p.2"})
    assert rt._live["run-p"].family == {"run-p", "run-p.1"}


def test_fork_is_refused_unless_the_controller_asked_for_exactly_that_many():
    rt = _runtime(max_forks=2)
    _instantiate(rt, "run-q", "forks=2")
    for into, why in ([["run-q.1", "run-q.2"], "did not ask for 3 forks"],
                      [[], "'into'"], [["run-q.1", "run-q.1"], "'into'"],
                      [["run-q"], "already instantiated"]):
        _advance(rt, "run-q")
        answer = _fork(rt, "run-q", into)
        assert answer["type"] == "error" and why in answer["error"], (into, answer)
    plain = _instantiate(rt, "run-r", "") and _advance(rt, "run-r")
    assert plain["pre"]["num_forks"] == 1
    assert "did not ask" in _fork(rt, "run-r", ["run-r.1"])["error"]
    # the limit counts the frontend's forks of the request
    _instantiate(rt, "run-m", "forks=3")
    assert "exceed the limit of 2" in _advance(rt, "run-m")["error"]


def test_a_suspended_controller_is_asked_again_by_the_next_advance():
    rt = _runtime()
    _instantiate(rt, "run-w", "wait=go")
    assert _advance(rt, "run-w")["pre"]["suspend"] is True
    assert _advance(rt, "run-w")["pre"]["suspend"] is True
    rt._live["run-w"].ctx.variables.write("go", b"1", append=False)  # as a sibling would
    assert _advance(rt, "run-w")["pre"]["suspend"] is False


def test_a_suspended_sequence_in_the_engine_is_asked_again_every_step():
    """The seed's engine path: a suspended sequence is not scheduled (no post), yet its pre
    phase runs each step until it may run."""
    rt = _runtime()
    _instantiate(rt, "run-e", "wait=go")
    first = _step(rt, pre_ops=[{"id": 3, "req_id": "run-e"}])
    assert first["pre_seqs"]["3"]["result"]["suspend"] is True
    assert _step(rt)["pre_seqs"]["3"]["result"]["suspend"] is True
    rt._seqs[3].ctx.variables.write("go", b"1", append=False)
    assert _step(rt)["pre_seqs"]["3"]["result"]["suspend"] is False
    assert "3" not in _step(rt)["pre_seqs"]  # no longer owed until a post


def test_the_seeds_clones_each_learn_their_branch_with_three_or_more():
    """Every copy is made before the parent is told it is branch 0 (a parent told first
    would have left its fork step when the next copy is made)."""
    rt = _runtime(max_forks=4)
    _instantiate(rt, "run-c", "forks=3 branch-ff")
    assert _step(rt, pre_ops=[{"id": 1, "req_id": "run-c"}])["pre_seqs"]["1"]["result"][
        "num_forks"] == 3
    mid = rt.handle_main({"op": "mid_process", "ops": [{"id": 1}, {"id": 5, "clone_id": 1},
                                                       {"id": 6, "clone_id": 1}]})
    assert all(not r["error"] for r in mid["data"]["seqs"].values()), mid
    data = _step(rt, post_ops=[{"id": i, "tokens": [7], "backtrack": 0} for i in (1, 5, 6)])
    assert [data["pre_seqs"][str(i)]["result"]["ff_tokens"] for i in (1, 5, 6)] == [
        [100], [101], [102]]


def test_the_fork_op_counts_forks_siblings_made_meanwhile():
    rt = _runtime(max_forks=3)
    _instantiate(rt, "run-l", "forks=3")
    assert _advance(rt, "run-l")["pre"]["num_forks"] == 3  # 3 <= 3 when it asked
    rt._live["run-l"].family.add("run-l.sibling")  # a sibling branch forked since
    answer = _fork(rt, "run-l", ["run-l.1", "run-l.2"])
    assert answer["type"] == "error" and "exceed the limit of 3" in answer["error"]
    assert "run-l.1" not in rt._live


def test_a_controller_that_raises_while_it_is_built_is_the_requests_error():
    class Broken(Controller):
        def __init__(self, ctx, arg, prompt):
            raise RuntimeError("cannot build")

    rt = WireRuntime(FakeTokenizer(), {"broken": Broken}, None, Limits())
    answer = _side(rt, {"op": "instantiate", "req_id": "run-b", "prompt": [1],
                        "module_id": "broken", "module_arg": ""})
    assert answer["type"] == "error" and answer["is_user_error"], answer
    assert answer["error"] == "RuntimeError: cannot build"


def test_the_runtime_and_the_rest_api_apply_the_same_tag_rules():
    from contract.controller_tags import check_tags

    rt = _runtime()
    mod = module_id_of(Scripted)
    admin = {"user": "root", "is_admin": True}
    # What the runtime let through before it shared the REST API's rules.
    for bad in (["alice.x\n"], ["0123456789abcdef0123"], ["scripted"], ["none"]):
        answer = _side(rt, {"op": "set_tags", "$auth": admin, "module_id": mod, "tags": bad})
        assert answer["type"] == "error" and answer["is_user_error"], bad
        assert answer["error"] == check_tags(bad, "root", True, {"scripted", "plain"})

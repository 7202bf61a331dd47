"""The controller runtime's typed messages (engines/controllers/ipc/messages.py): a malformed
command is the sender's error in the runtime's error shape, on either channel, and a step's
answer reads back as the rows it ends."""

import msgspec
import pytest

from engines.controllers.ipc.messages import (
    AdvanceAnswer,
    BadMessage,
    MainCommand,
    PreState,
    StepAnswer,
    read,
)
from tests.unit.test_controller_runtime import _instantiate, _runtime, _side


@pytest.mark.parametrize("cmd", [
    {"op": "step", "post_ops": [{"tokens": [1]}]},  # no sequence id
    {"op": "step", "post_ops": [{"id": 1, "tokens": "abc"}]},
    {"op": "post_pre_process", "pre_ops": [{"id": "one", "req_id": "r"}]},
    {"op": "mid_process", "ops": [{"id": 1, "clone_id": [2]}]},
    {"op": "step", "mask_format": "hex"},
])
def test_a_malformed_main_command_is_a_user_error_naming_the_field(cmd):
    answer = _runtime().handle_main(cmd)
    assert answer["type"] == "error" and answer["is_user_error"]
    kind = {"step": "Step", "post_pre_process": "PostPreProcess", "mid_process": "MidProcess"}
    assert answer["error"].startswith(f"malformed {kind[cmd['op']]} message")  # by its op
    assert "$." in answer["error"]  # where in the command


@pytest.mark.parametrize("handle", ["handle_main", "handle_side"])
def test_an_unknown_op_is_a_user_error_naming_the_known_ones(handle):
    got = []
    answer = getattr(_runtime(), handle)({"op": "nope", "$rid": "r"}, *(
        [got.append] if handle == "handle_side" else []))
    answer = answer or got[0]
    answer = answer if isinstance(answer, dict) else msgspec.to_builtins(answer)
    assert answer["type"] == "error" and answer["is_user_error"]
    assert "unknown" in answer["error"] and "'nope'" in answer["error"]
    assert "ping" in answer["error"] or "instantiate" in answer["error"]


def test_numbers_sent_as_strings_are_read_as_numbers():
    """What a JSON producer without int keys sends (``strict=False``)."""
    command = read({"op": "step", "freed": ["3"], "mid_ops": [{"id": "4"}]}, MainCommand)
    assert command.freed == [3] and command.mid_ops[0].id == 4


@pytest.mark.parametrize("request_", [
    {"op": "advance", "req_id": "run-m", "tokens": "abc"},
    {"op": "advance", "req_id": "run-m", "backtrack": [1]},
    {"op": "fork", "req_id": "run-m", "into": "run-m.1"},
    {"op": "instantiate", "req_id": "run-n", "module_id": "scripted", "prompt": {"a": 1}},
    {"op": "set_tags", "module_id": 7, "tags": ["x"]},
])
def test_a_malformed_side_request_is_a_user_error(request_):
    rt = _runtime()
    _instantiate(rt, "run-m", "")
    answer = _side(rt, {"$rid": "r", **request_})
    assert answer["type"] == "error" and answer["is_user_error"], answer
    assert answer["error"].startswith("malformed ")
    assert "run-n" not in rt._live  # nothing was built from a malformed instantiate


def test_a_step_answer_ends_stopped_failed_and_editing_rows_only():
    answer = read({
        "post_seqs": {"1": {"error": "", "result": {"stop": True}},
                      "2": {"error": "", "result": {"stop": False}},
                      "3": {"error": "boom", "result": None}},
        "pre_seqs": {"4": {"result": {"suspend": False, "num_forks": 1, "ff_tokens": [5]}},
                     "5": {"result": {"suspend": False, "num_forks": 1, "ff_tokens": []}},
                     "6": {"result": {"suspend": False, "num_forks": 1, "ff_tokens": [],
                                      "backtrack": 1}}},
        "mid": {"seqs": {"7": {"error": "bad mask"}, "8": {"error": ""}}, "ids": [8]},
    }, StepAnswer)
    assert answer.ends() == {1, 3, 4, 6, 7}
    assert answer.mid.ids == [8]


def test_an_advance_answer_reads_the_runtimes_own_answer():
    rt = _runtime()
    data = _side(rt, {"op": "instantiate", "$rid": "r", "req_id": "run-a", "prompt": [1],
                      "module_id": "scripted", "module_arg": "ff=3,4",
                      "advance": True})["data"]
    state = read(data, AdvanceAnswer)
    assert not state.stop and not state.error and state.binds == 0
    assert state.pre == PreState(ff_tokens=[3, 4]) and state.pre.wants_edit


def test_bad_message_is_a_value_error_with_the_type_named():
    with pytest.raises(BadMessage, match="AdvanceAnswer"):
        read({"stop": "maybe"}, AdvanceAnswer)


def test_an_auth_without_is_admin_is_not_an_admin_and_a_malformed_one_is_refused():
    rt = _runtime()
    mod = _side(rt, {"op": "get_tags", "$rid": "a"})["data"]["tags"][0]["module_id"]
    partial = _side(rt, {"op": "set_tags", "$auth": {"user": "bob"}, "module_id": mod,
                         "tags": ["other"]})
    assert partial["type"] == "error" and "permission denied" in partial["error"]
    malformed = _side(rt, {"op": "set_tags", "$auth": {"user": 5}, "module_id": mod,
                           "tags": ["bob.x"]})
    assert malformed["type"] == "error" and malformed["is_user_error"]
    local = _side(rt, {"op": "set_tags", "module_id": mod, "tags": ["anyone"]})
    assert local["type"] == "ok"  # no $auth: the engine's own request, as an admin


def test_the_hooks_binding_is_read_strictly():
    from vllm import SamplingParams

    from engines.vllm.controller_hook import AICI_ARG, parse_row_spec

    def params(spec):
        return SamplingParams(extra_args={AICI_ARG: spec}, ignore_eos=True)

    assert parse_row_spec(params({"seq": 3, "req_id": "r"})).seq == 3
    for bad in ({"seq": "3", "req_id": "r"}, {"seq": 3}, [3, "r"]):
        with pytest.raises(ValueError, match="extra_args"):
            parse_row_spec(params(bad))

"""The frontend driver of controlled requests (engines/vllm/controlled.py) against the real
controller runtime and a scripted stand-in for vLLM + the hook: each segment binds its
controller (``pre_ops``), reports each sampled token (``post_ops``), and ends on EOS when the
controller stops or asks for fast-forward, as the hook makes vLLM do."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from engines.controllers.runtime import ControllerRuntime, Limits
from engines.controllers.shm import ChannelFull, ChannelTimeout, RuntimeReplyError
from engines.vllm.controlled import ControlledRun, Segment
from protocols.internal import (
    ControllerSpec,
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    OutputOptions,
    Sampling,
    TextPrompt,
    TokenEvent,
)
from tests.controllers import FakeTokenizer, Scripted

EOS = 0


class _Side:
    """SideClient's interface over the runtime in this process."""

    def __init__(self, rt):
        self.rt = rt
        self.ops: list[str] = []

    def request(self, op, auth=None, timeout=10.0, **fields):
        self.ops.append(op)
        fut: Future = Future()

        def reply(answer):
            if answer["type"] == "ok":
                fut.set_result(answer["data"])
            else:
                fut.set_exception(RuntimeReplyError(answer["error"], answer["is_user_error"]))
        self.rt.handle_side({"op": op, **fields, "$rid": "x"}, reply)
        return fut


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + t) if t else ("" if skip_special_tokens else "<eos>")
                       for t in ids)


class _Model:
    """The model samples ``script`` in order (cycling); EOS in it is a sampled EOS."""

    def __init__(self, rt, script):
        self.rt, self.script, self.k = rt, script, 0
        self.prompts: list[list[int]] = []

    async def segment(self, ids, max_tokens, binding, seg: Segment):
        self.prompts.append(list(ids))
        seq = binding["seq"]
        post = []
        pre_ops = [{"id": seq, "req_id": binding["req_id"]}]
        for n in range(max_tokens):
            data = self.rt.handle_main({"op": "post_pre_process", "post_ops": post,
                                        "pre_ops": pre_ops, "freed": []})["data"]
            pre_ops = []
            done = data["post_seqs"].get(str(seq)) or {}
            ahead = (data["pre_seqs"].get(str(seq)) or {})
            ending = done.get("error") or (done.get("result") or {}).get("stop") or \
                ahead.get("error") or (ahead.get("result") or {}).get("ff_tokens")
            token = EOS if ending else self.script[self.k % len(self.script)]
            if not ending:
                self.k += 1
            last = ending or token == EOS or n == max_tokens - 1
            if last:
                seg.finish = "stop" if token == EOS else "length"
            yield TokenEvent(token_id=token, text=_Tok().decode([token]), last=bool(last))
            if last:
                return
            post = [{"id": seq, "tokens": [token], "backtrack": 0}]


def _run(arg, script, max_tokens=8, module="scripted", **request):
    rt = ControllerRuntime(FakeTokenizer(), {"scripted": Scripted, "boom": _FailsOnSecondToken},
                           None, Limits(step_s=1.0))
    side, model = _Side(rt), _Model(rt, script)
    req = GenerateRequest(request_id="r", model="m", prompt=TextPrompt(text="p"),
                          sampling=Sampling(max_tokens=max_tokens, **request.pop("sampling", {})),
                          controller=ControllerSpec(module=module, arg=arg), **request)
    run = ControlledRun(req, [9, 9], max_tokens, side, _Tok(), EOS, model.segment)

    async def collect():
        return [e async for e in run.stream()]
    return asyncio.run(collect()), model, side, run


def _tokens(events):
    return [(e.token_id, e.forced) for e in events if isinstance(e, TokenEvent)]


def test_forced_tokens_come_first_then_sampling_resumes_on_the_extended_prompt():
    events, model, side, _ = _run("ff=1,2 stop-after=4", [5, 6, 7])
    # the controller stops: the run ends on the stop token the hook forced (as a plain
    # request ends on its EOS), which carries the finish
    assert _tokens(events) == [(1, True), (2, True), (5, False), (6, False), (EOS, False)]
    assert [e.last for e in events if isinstance(e, TokenEvent)] == [False] * 4 + [True]
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.finish_reason == "eos"
    assert final.usage.completion_tokens == 5 and final.usage.forced_tokens == 2
    # forced text before any prefill: the one segment starts after them
    assert model.prompts == [[9, 9, 1, 2]]
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == "abef"
    assert side.ops[0] == "instantiate" and side.ops[-1] == "release"


def test_a_sampled_eos_is_a_token_to_the_controller_and_the_run_goes_on():
    # the model samples EOS itself: an ordinary token to the controller, which goes on
    events, model, _, _ = _run("stop-after=3", [5, EOS, 6])
    assert _tokens(events) == [(5, False), (EOS, False), (6, False), (EOS, False)]
    assert len(model.prompts) == 2 and model.prompts[1] == [9, 9, 5, EOS]
    assert events[-1].finish_reason == "eos"
    assert [e.last for e in events if isinstance(e, TokenEvent)] == [False, False, False, True]


def test_the_token_budget_ends_the_run_with_length_and_last_on_the_last_token():
    events, *_ = _run("", [5], max_tokens=3)
    assert _tokens(events) == [(5, False)] * 3
    assert [e.last for e in events if isinstance(e, TokenEvent)] == [False, False, True]
    assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 3


def test_forced_tokens_beyond_the_budget_are_cut_at_it():
    events, model, *_ = _run("ff=1,2,3", [5], max_tokens=2)
    assert _tokens(events) == [(1, True), (2, True)]
    assert [e.last for e in events if isinstance(e, TokenEvent)] == [False, True]
    assert events[-1].finish_reason == "length" and model.prompts == []


@pytest.mark.parametrize("arg, module, needle", [
    ("bad", "scripted", "bad program"),
    ("", "nope", "unknown controller"),
    ("forks=2", "scripted", "forked or suspended"),
])
def test_controller_failures_are_one_validation_error_and_release_the_controller(
        arg, module, needle):
    events, _, side, _ = _run(arg, [5], module=module)
    assert isinstance(events[-1], ErrorEvent) and events[-1].param == "controller"
    assert events[-1].kind == "validation" and needle in events[-1].message
    assert side.ops[-1] == "release"


class _FailsOnSecondToken(Scripted):
    def post_process(self, tokens, backtrack):
        if len(self.seen) >= 1:
            raise KeyError("controller bug")
        return super().post_process(tokens, backtrack)


def test_a_controller_failing_mid_run_ends_the_stream_with_its_error_after_its_tokens():
    events, _, side, _ = _run("", [5, 6, 7], module="boom")
    assert _tokens(events) == [(5, False), (6, False)]
    assert isinstance(events[-1], ErrorEvent) and "KeyError: 'controller bug'" in \
        events[-1].message
    assert side.ops[-1] == "release"


@pytest.mark.parametrize("request_fields, param", [
    ({"sampling": {"n": 2}}, "n"),
    ({"sampling": {"stop": ("x",)}}, "stop"),
    ({"output": OutputOptions(echo=True)}, "echo"),
])
def test_what_cannot_combine_with_a_controller_is_refused_before_it_starts(request_fields,
                                                                           param):
    events, _, side, _ = _run("", [5], **request_fields)
    assert len(events) == 1 and events[0].param == param and side.ops == []


def test_the_stop_token_that_ends_a_segment_for_forced_tokens_is_not_output():
    # "ff=7" after the first sampled token: the hook ends the segment on EOS, the driver drops
    # it, appends 7 and resubmits
    class LateForce(Scripted):
        def pre_process(self):
            result = super().pre_process()
            if len(self.seen) == 1 and not getattr(self, "done", False):
                self.done = True
                result.ff_tokens = [7]
            return result

    rt = ControllerRuntime(FakeTokenizer(), {"late": LateForce}, None, Limits(step_s=1.0))
    side, model = _Side(rt), _Model(rt, [5, 6])
    req = GenerateRequest(request_id="r", model="m", prompt=TextPrompt(text="p"),
                          sampling=Sampling(max_tokens=4),
                          controller=ControllerSpec(module="late", arg=""))
    run = ControlledRun(req, [9], 4, side, _Tok(), EOS, model.segment)

    async def collect():
        return [e async for e in run.stream()]
    events = asyncio.run(collect())
    assert _tokens(events) == [(5, False), (7, True), (6, False), (5, False)]
    assert model.prompts == [[9], [9, 5, 7]]
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == "egfe"
    assert events[-1].finish_reason == "length"


@pytest.mark.parametrize("exc, kind, message", [
    (ChannelFull("256 side requests already wait"), "overloaded", "retry later"),
    (ChannelTimeout("/llmgw-1-abc-cmd-side: no free slot within 10 s"), "engine",
     "controller runtime unreachable"),
])
def test_a_full_or_dead_side_channel_is_overload_or_an_engine_error_without_its_names(
        exc, kind, message):
    class Broken(_Side):
        def request(self, op, auth=None, timeout=10.0, **fields):
            self.ops.append(op)
            raise exc

    rt = ControllerRuntime(FakeTokenizer(), {"scripted": Scripted}, None, Limits())
    req = GenerateRequest(request_id="r", model="m", prompt=TextPrompt(text="p"),
                          sampling=Sampling(max_tokens=2),
                          controller=ControllerSpec(module="scripted", arg=""))
    run = ControlledRun(req, [9], 2, Broken(rt), _Tok(), EOS, _Model(rt, [5]).segment)

    async def collect():
        return [e async for e in run.stream()]
    events = asyncio.run(collect())
    assert len(events) == 1 and events[0].kind == kind and message in events[0].message
    assert "/" not in events[0].message  # no shm names

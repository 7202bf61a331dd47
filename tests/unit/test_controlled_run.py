"""The frontend driver of controlled requests (engines/controllers/driver/run.py) against the real
controller runtime and a scripted stand-in for vLLM + the hook: each segment binds its
controller (``pre_ops``), reports each sampled token (``post_ops``), and ends on EOS when the
controller stops or asks for fast-forward, as the hook makes vLLM do."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future

import pytest

from contract import (
    BacktrackEvent,
    ControllerSpec,
    ErrorEvent,
    FinalEvent,
    ForkEvent,
    GenerateRequest,
    OutputOptions,
    Sampling,
    TextPrompt,
    TokenEvent,
)
from engines.controllers.api.base import PreResult
from engines.controllers.driver.run import ControlledRun, Segment
from engines.controllers.ipc.channels import RuntimeReplyError
from engines.controllers.ipc.shm import ChannelFull, ChannelTimeout
from engines.controllers.runtime.runtime import Limits
from tests.controllers import Backtracking, FakeTokenizer, Scripted, WireRuntime, as_wire

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
    """The model samples ``script`` in order (cycling); EOS in it is a sampled EOS. Ends the
    segment where the hook would: the controller stopped or failed, or wants an edit."""

    def __init__(self, rt, script, tok=None):
        self.rt, self.script, self.k, self.tok = rt, script, 0, tok or _Tok()
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
            # with forks, another branch's step call may have run this one's pre (the real
            # engine's step covers every running row): the runtime keeps what it answered
            bound = self.rt._seqs.get(seq)
            kept = bound.last_pre if bound is not None else None
            wants = ahead.get("result") or (as_wire(kept) if kept is not None else None) or {}
            ending = done.get("error") or (done.get("result") or {}).get("stop") or \
                ahead.get("error") or wants.get("ff_tokens") or wants.get("backtrack")
            token = EOS if ending else self.script[self.k % len(self.script)]
            if not ending:
                self.k += 1
            last = ending or token == EOS or n == max_tokens - 1
            if last:
                seg.finish = "stop" if token == EOS else "length"
            yield TokenEvent(token_id=token, text=self.tok.decode([token]), last=bool(last))
            if last:
                return
            post = [{"id": seq, "tokens": [token], "backtrack": 0}]


def _run(arg, script, max_tokens=8, module="scripted", controllers=None, prompt=(9, 9),
         tok=None, info=None, model_cls=None, **request):
    """One controlled run; ``controllers`` (default: the scripted ones) by tag, ``tok`` the
    driver's and the stand-in model's tokenizer, ``info`` the controllers'."""
    controllers = controllers or {"scripted": Scripted, "boom": _FailsOnSecondToken,
                                  "backtrack": Backtracking}
    rt = WireRuntime(info or FakeTokenizer(), controllers, None, Limits(step_s=1.0))
    side, model = _Side(rt), (model_cls or _Model)(rt, script, tok)
    req = GenerateRequest(request_id="r", model="m", prompt=TextPrompt(text="p"),
                          sampling=Sampling(max_tokens=max_tokens, **request.pop("sampling", {})),
                          controller=ControllerSpec(module=module, arg=arg), **request)
    run = ControlledRun(req, list(prompt), max_tokens, side, tok or _Tok(), EOS, model.segment)

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
    ("forks=2 ff=5", "scripted", "cannot also force"),
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

    events, model, *_ = _run("", [5, 6], max_tokens=4, module="late",
                             controllers={"late": LateForce}, prompt=[9])
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

    rt = WireRuntime(FakeTokenizer(), {"scripted": Scripted}, None, Limits())
    req = GenerateRequest(request_id="r", model="m", prompt=TextPrompt(text="p"),
                          sampling=Sampling(max_tokens=2),
                          controller=ControllerSpec(module="scripted", arg=""))
    run = ControlledRun(req, [9], 2, Broken(rt), _Tok(), EOS, _Model(rt, [5]).segment)

    async def collect():
        return [e async for e in run.stream()]
    events = asyncio.run(collect())
    assert len(events) == 1 and events[0].kind == kind and message in events[0].message
    assert "/" not in events[0].message  # no shm names


def test_a_backtrack_withdraws_tokens_then_forced_ones_follow_and_sampling_resumes():
    # after 3 sampled tokens (5, 6, 7) the controller withdraws 2 and forces 9
    events, model, _, run = _run("after=3 back=2 ff=9", [5, 6, 7, 8], max_tokens=6,
                                 module="backtrack")
    kinds = [(type(e).__name__, getattr(e, "token_id", getattr(e, "count", None)))
             for e in events]
    assert kinds == [("TokenEvent", 5), ("TokenEvent", 6), ("TokenEvent", 7),
                     ("BacktrackEvent", 2), ("TokenEvent", 9), ("TokenEvent", 8),
                     ("TokenEvent", 5), ("TokenEvent", 6), ("TokenEvent", 7),
                     ("FinalEvent", None)]
    backtrack = next(e for e in events if isinstance(e, BacktrackEvent))
    assert backtrack.text == "fg"  # what the withdrawn tokens' events had added
    # the resubmission is the prompt, the kept tokens and the forced one: no withdrawn token
    assert model.prompts[1] == [9, 9, 5, 9]
    # max_tokens bounds the output as returned: withdrawn tokens make room again
    assert run.out == [5, 9, 8, 5, 6, 7]
    final = events[-1]
    assert final.finish_reason == "length"
    assert (final.usage.completion_tokens, final.usage.forced_tokens,
            final.usage.sampled_tokens) == (6, 1, 7)
    assert [e.last for e in events if isinstance(e, TokenEvent)] == [False] * 7 + [True]


def test_a_backtrack_past_the_output_fails_the_run_in_shape():
    events, *_ = _run("after=1 back=4", [5, 6], module="backtrack")
    assert isinstance(events[-1], ErrorEvent) and events[-1].param == "controller"
    assert "withdrew 4 tokens, but only 1" in events[-1].message


def test_a_controller_that_keeps_withdrawing_still_ends_at_four_times_the_budget():
    class Undo(Scripted):  # withdraws every token it gets and forces 9 instead
        def pre_process(self):
            return PreResult(backtrack=1, ff_tokens=[9]) if self.seen else PreResult()

    events, _, _, run = _run("", [5], max_tokens=3, module="undo", controllers={"undo": Undo},
                             prompt=[9])
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.finish_reason == "length"
    assert run.output.sampled + run.output.forced == 12 and len(run.out) < 3


class _Bytes:
    """Byte-level tokens (id = byte + 1; 0 = EOS): text and ids map one to one."""

    vocab_size, eos_token_id = 257, 0

    def encode(self, text):
        return [b + 1 for b in text.encode()]

    def decode(self, tokens, skip_special_tokens=True):
        return bytes(t - 1 for t in tokens if t).decode(errors="replace")


def test_the_redact_example_withdraws_a_word_and_forces_its_replacement():
    from engines.controllers.api.examples import Redact

    tok = _Bytes()

    class Info(_Bytes):
        def decode(self, tokens):
            return bytes(t - 1 for t in tokens if t)

    arg = json.dumps({"words": ["Paris"], "replacement": "[X]"})
    events, _, _, run = _run(arg, tok.encode(" Paris is big"), max_tokens=20, module="redact",
                             controllers={"redact": Redact}, prompt=[1], tok=tok, info=Info())
    backtracks = [e for e in events if isinstance(e, BacktrackEvent)]
    assert [(b.count, b.text) for b in backtracks] == [(5, "Paris")] * 2
    assert tok.decode(run.out) == " [X] is big [X] is b"  # 20 tokens; the model cycles
    assert "Paris" not in tok.decode(run.out)


def test_logs_and_variables_from_the_engines_steps_reach_the_client_once_each():
    # post_process runs inside the engine's steps (the stand-in's post_pre_process) for the
    # sampled tokens, and once through advance for the last one: each entry is carried once,
    # by the first event after the driver learns of it (here the last token)
    events, *_ = _run("var=v stop-after=3", [5, 6, 7])
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.finish_reason == "eos"
    carriers = [e for e in events if isinstance(e, (TokenEvent, FinalEvent))]
    assert "".join(e.logs for e in carriers) == "wrote [5]\nwrote [6]\nwrote [7]\n"
    writes = [entry["WriteVar"] for e in carriers for entry in e.storage]
    assert [(w["name"], bytes.fromhex(w["value"]), w["op"]) for w in writes] == [
        ("v", bytes([5]), "Append"), ("v", bytes([6]), "Append"), ("v", bytes([7]), "Append")]
    assert sum(e.micros for e in carriers) > 0  # the calls' time, AICI's "micros"


def test_logs_stream_with_the_token_after_them_not_only_at_the_end():
    # the forced tokens' post_process logs at the advance before the first segment: the first
    # token emitted after that carries it, long before the run ends
    events, *_ = _run("ff=1,2 var=v stop-after=6", [5, 6, 7, 8])
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    first = next(i for i, e in enumerate(tokens) if e.logs)
    assert tokens[first].logs == "wrote [1, 2]\n" and first < len(tokens) - 1
    assert not tokens[first].last


def test_segments_the_hook_never_saw_fail_the_run_instead_of_looping():
    class DeadHook(_Model):  # vLLM ends every row at once on its stop token, binding nothing
        async def segment(self, ids, max_tokens, binding, seg: Segment):
            self.prompts.append(list(ids))
            seg.finish = "stop"
            yield TokenEvent(token_id=EOS, text="", last=True)

    events, model, *_ = _run("", [5], max_tokens=50, model_cls=DeadHook, prompt=[9])
    assert isinstance(events[-1], ErrorEvent) and events[-1].kind == "engine"
    assert "hook did not run" in events[-1].message and len(model.prompts) == 1


def test_forced_tokens_that_fill_the_budget_still_reach_the_controller_which_may_stop():
    events, model, *_ = _run("ff=1,2 stop-after=2", [5], max_tokens=2)
    assert _tokens(events) == [(1, True), (2, True)]
    assert events[-1].finish_reason == "eos" and model.prompts == []


# --- forks and suspends ------------------------------------------------------------------------

def _by_choice(events):
    out: dict[int, list] = {}
    for e in events:
        if isinstance(e, TokenEvent):
            out.setdefault(e.index, []).append((e.token_id, e.forced))
    return out


def test_a_fork_announces_each_new_choice_before_its_events_and_each_runs_its_segments():
    events, model, side, _ = _run("forks=3 branch-ff", [5, 6], max_tokens=4)
    forks = [e for e in events if isinstance(e, ForkEvent)]
    assert [(f.index, f.parent) for f in forks] == [(1, 0), (2, 0)]
    for fork in forks:  # announced before any event of its choice
        first = next(i for i, e in enumerate(events)
                     if not isinstance(e, ForkEvent) and getattr(e, "index", None) == fork.index)
        assert events.index(fork) < first
    tokens = _by_choice(events)
    assert sorted(tokens) == [0, 1, 2]
    for index, got in tokens.items():  # each branch forced 100 + its index, then sampled
        assert got[0] == (100 + index, True) and len(got) == 4, got
        assert all(not forced for _, forced in got[1:])
    finals = {e.index: e for e in events if isinstance(e, FinalEvent)}
    assert sorted(finals) == [0, 1, 2] and isinstance(events[-1], FinalEvent)
    assert all(f.finish_reason == "length" and f.usage.completion_tokens == 4
               for f in finals.values())
    for index in finals:  # its last token is marked last
        assert [e for e in events if isinstance(e, TokenEvent) and e.index == index][-1].last
    # every branch's segments start from the prompt and its own output (its forced token)
    assert sorted(p[:3] for p in model.prompts[:3]) == [[9, 9, 100], [9, 9, 101], [9, 9, 102]]
    assert side.ops.count("fork") == 1 and side.ops.count("release") == 3


def test_a_suspended_branch_runs_once_a_sibling_writes_what_it_waits_for():
    events, _, _, _ = _run("forks=2 var=v wait=v wait-branch=1", [5, 6], max_tokens=3)
    assert not any(isinstance(e, ErrorEvent) for e in events), events[-1]
    tokens = _by_choice(events)
    assert len(tokens[0]) == 3 and len(tokens[1]) == 3
    # branch 1 starts only after branch 0 reported its first write (its first token's advance)
    first_of_1 = next(i for i, e in enumerate(events) if isinstance(e, TokenEvent) and e.index)
    assert any(isinstance(e, TokenEvent) and e.index == 0 for e in events[:first_of_1])
    assert sum(isinstance(e, FinalEvent) for e in events) == 2


def test_every_branch_suspended_ends_the_run_as_a_deadlock():
    events, _, side, _ = _run("wait=never", [5])
    assert isinstance(events[-1], ErrorEvent) and events[-1].param == "deadlock"
    assert "suspended" in events[-1].message
    assert side.ops[-1] == "release"
    events, _, side, _ = _run("forks=2 wait=never wait-branch=1 stop-after=2", [5])
    assert isinstance(events[-1], ErrorEvent) and events[-1].param == "deadlock"
    # branch 0 finished first; then branch 1 alone waits for what nobody will write
    assert any(isinstance(e, FinalEvent) and e.index == 0 for e in events)
    assert side.ops.count("release") == 2


def test_an_error_in_one_branch_ends_the_stream_and_releases_every_branch():
    events, _, side, _ = _run("forks=2 branch-ff", [5], module="boom")
    assert isinstance(events[-1], ErrorEvent) and "controller bug" in events[-1].message
    assert side.ops.count("release") == 2


def _released(rt, within_s: float = 5.0) -> bool:
    """Whether the runtime dropped every controller (it answers release on its own threads)."""
    import time

    deadline = time.monotonic() + within_s
    while rt._live and time.monotonic() < deadline:
        time.sleep(0.01)
    return rt._live == {}


class _SlowModel(_Model):
    """Yields a step at a time (as a real engine does) and records which segments were
    closed before they finished: closing a segment is how the engine aborts its request."""

    def __init__(self, rt, script, tok=None):
        super().__init__(rt, script, tok)
        self.open = 0
        self.aborted = 0

    async def segment(self, ids, max_tokens, binding, seg: Segment):
        self.open += 1
        finished = False
        try:
            async for event in super().segment(ids, max_tokens, binding, seg):
                await asyncio.sleep(0.001)
                yield event
            finished = True
        finally:
            self.open -= 1
            self.aborted += not finished


def _forking_run(request_id: str):
    """A run whose controller forks into 3 at once, over a model that yields step by step."""
    rt = WireRuntime(FakeTokenizer(), {"scripted": Scripted}, None, Limits(step_s=1.0))
    side, model = _Side(rt), _SlowModel(rt, [5, 6])
    req = GenerateRequest(request_id=request_id, model="m", prompt=TextPrompt(text="p"),
                          sampling=Sampling(max_tokens=50),
                          controller=ControllerSpec(module="scripted", arg="forks=3 branch-ff"))
    return rt, side, model, ControlledRun(req, [9], 50, side, _Tok(), EOS, model.segment)


def test_closing_a_forked_stream_aborts_every_branch_and_releases_every_controller():
    rt, side, model, run = _forking_run("r")

    async def consume_a_little():
        seen = []
        stream = run.stream()
        async for event in stream:
            seen.append(event)
            if sum(isinstance(e, TokenEvent) for e in seen) >= 8:
                break
        await stream.aclose()  # the client went away
        return seen

    seen = asyncio.run(consume_a_little())
    assert sum(isinstance(e, ForkEvent) for e in seen) == 2
    assert model.open == 0 and model.aborted >= 2  # every running segment was closed
    assert side.ops.count("release") == 3  # the request's controller and both forks'
    assert _released(rt)


def test_forks_a_protocol_refuses_are_released_though_their_branches_never_start():
    """The host ends a stream at a ForkEvent its protocol cannot show (an OpenAI stream):
    the copies the runtime made are released all the same."""
    rt, side, model, run = _forking_run("r.fx")  # ".f" as in the forks' own ids

    async def until_the_first_fork():
        stream = run.stream()
        async for event in stream:
            if isinstance(event, ForkEvent):
                break
        await stream.aclose()

    asyncio.run(until_the_first_fork())
    assert side.ops.count("release") == 3 and _released(rt)
    assert model.open == 0

"""EngineHost: the generic half of every engine kind (admission, deadline, splice guard,
accounting, failures as events), over the fake kind; and the engine-kind registry."""

from __future__ import annotations

import asyncio
import importlib
import json

import msgspec
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
    Usage,
)
from engines.kit import placement
from engines.kit.config import ModelConfig
from engines.kit.kinds import ENGINE_KINDS, EngineKind, create_engine
from tests.fake_engine import FakeEngine


def _request(rid="r", text="Hi", splices="append", script=None, **sampling) -> GenerateRequest:
    controller = (ControllerSpec(module="fake-splice", arg=json.dumps(script))
                  if script is not None else None)
    return GenerateRequest(request_id=rid, model="m", prompt=TextPrompt(text=text),
                           sampling=Sampling(**{"max_tokens": 4, **sampling}),
                           output=OutputOptions(splices=splices), controller=controller)


async def _events(engine, request) -> list:
    return [e async for e in engine.generate(request)]


async def test_refused_requests_never_reach_the_engine_kind():
    engine = FakeEngine()
    [event] = await _events(engine, _request(text="x" * 64))
    assert isinstance(event, ErrorEvent) and event.param == "prompt"
    assert "maximum context length is 64" in event.message
    assert not engine.model.cancelled and (await engine.stats()).active == 0


async def test_admission_reports_the_first_problem_in_a_fixed_order():
    # the controller is checked before the prompt, the prompt before the sampling options
    engine = FakeEngine()
    request = _request(text="", script={}, max_tokens=0)
    [event] = await _events(engine, request)
    assert event.param == "controller" and "fake engine" in event.message
    [event] = await _events(engine, _request(text="", max_tokens=0))
    assert (event.param, event.message) == ("prompt", "prompt is empty")
    [event] = await _events(engine, _request(max_tokens=0))
    assert (event.param, event.message) == ("max_tokens", "max_tokens must be at least 1")


async def test_unset_max_tokens_is_the_room_left_in_the_context():
    events = await _events(FakeEngine(reply="ab"), _request(max_tokens=None, ignore_eos=True))
    assert events[-1].usage.completion_tokens == 64 - 2


async def test_best_of_above_n_is_refused_by_capability():
    [event] = await _events(FakeEngine(), _request(n=1, best_of=2))
    assert event.param == "best_of" and "fake engine" in event.message


async def test_deadline_ends_open_choices_with_honest_usage():
    engine = FakeEngine(delay=0.05)
    request = GenerateRequest(request_id="d", model="m", prompt=TextPrompt(text="Hi"),
                              sampling=Sampling(n=2, max_tokens=40, ignore_eos=True),
                              timeout_s=0.3)
    events = await _events(engine, request)
    finals = [e for e in events if isinstance(e, FinalEvent)]
    assert [f.index for f in finals] == [0, 1]  # choice 1 never started: 0 tokens
    for final in finals:
        tokens = [e for e in events if isinstance(e, TokenEvent) and e.index == final.index]
        assert (final.finish_reason, final.stop_reason) == ("abort", "timeout")
        assert final.usage.completion_tokens == len(tokens)
    assert engine.model.cancelled == ["d"]  # the engine's stream was closed, not left running
    stats = await engine.stats()
    assert (stats.active, stats.aborted, stats.started) == (0, 0, 1)


async def test_closing_early_counts_an_abort_and_closes_the_engine_stream():
    engine = FakeEngine(delay=0.01)
    stream = engine.generate(_request(rid="gone", max_tokens=40, ignore_eos=True))
    await anext(stream)
    assert (await engine.stats()).active == 1
    await stream.aclose()
    stats = await engine.stats()
    assert (stats.active, stats.aborted) == (0, 1) and engine.model.cancelled == ["gone"]


async def test_an_engine_failure_becomes_an_engine_error_event():
    engine = FakeEngine()

    async def broken(request, admitted):
        yield TokenEvent(token_id=1, text="x")
        raise RuntimeError("device lost")

    engine.engine.stream = broken  # type: ignore[method-assign]
    events = await _events(engine, _request())
    assert isinstance(events[0], TokenEvent)
    assert events[-1].kind == "engine" and "engine failure" in events[-1].message
    assert "device lost" not in events[-1].message  # logged, not sent to clients
    assert (await engine.stats()).active == 0


@pytest.mark.parametrize("splices, allowed", [
    ("append", ()), ("retract", (BacktrackEvent,)), ("full", (BacktrackEvent, ForkEvent))])
async def test_splices_reach_only_consumers_that_render_them(splices, allowed):
    engine = FakeEngine(controllers="splice")
    script = {"ff": "ab", "backtrack": 2, "fork": 1}
    events = await _events(engine, _request(splices=splices, script=script, max_tokens=5))
    assert [e.text for e in events[:2]] == ["a", "b"] and events[0].forced
    kinds = {type(e) for e in events}
    assert kinds & {BacktrackEvent, ForkEvent} == set(allowed)
    if splices == "full":
        assert sorted(e.index for e in events if isinstance(e, FinalEvent)) == [0, 1]
    else:
        refusal = events[-1]
        assert isinstance(refusal, ErrorEvent) and refusal.param == "controller"
        assert engine.model.cancelled  # the refused request was stopped in the engine


async def test_tokenize_and_reference_capability():
    engine = FakeEngine()
    assert await engine.tokenize(TextPrompt(text="ab")) == (97, 98)
    assert await engine.detokenize((97, 98)) == "ab"
    with pytest.raises(NotImplementedError, match="fake engine has no reference decoder"):
        await engine.reference_greedy("ab", 2)


def test_engine_kinds_are_validated_and_built_by_name(monkeypatch):
    with pytest.raises(ValueError, match="unknown engine kind 'nope'"):
        ModelConfig(engine="nope")

    monkeypatch.setitem(ENGINE_KINDS, "fake", EngineKind(
        implementation="tests.unit.test_engine_host:_FromConfig", concurrency_arg="batch",
        default_concurrency=3))
    config = ModelConfig(name="x", engine="fake")
    assert config.ongoing_limit() == 6  # twice what it batches, from the same entry
    engine = create_engine(config)
    # (pytest imports this file under another module name than the kind's path gives)
    assert type(engine).__name__ == "_FromConfig" and engine.config.name == "x"


@pytest.mark.parametrize("computes_in, steps", [
    ("own_worker", ["claim", "start", "place"]),  # vLLM: the node moves off its worker
    ("replica", ["claim", "start"]),  # the pipeline's origin: keeps every CPU it claimed
])
def test_an_engine_starts_inside_the_placement_step_its_kind_names(monkeypatch, computes_in,
                                                                   steps):
    done: list[str] = []
    monkeypatch.setattr(placement, "claim", lambda: done.append("claim") or {0})
    monkeypatch.setattr(placement, "place", lambda **_: done.append("place") or None)
    # the class as the kind's path imports it (pytest names this module otherwise)
    built = importlib.import_module("tests.unit.test_engine_host")._FromConfig
    monkeypatch.setattr(built, "started", lambda: done.append("start"))
    monkeypatch.setitem(ENGINE_KINDS, "fake", EngineKind(
        implementation="tests.unit.test_engine_host:_FromConfig", concurrency_arg="batch",
        default_concurrency=3, computes_in=computes_in))
    create_engine(ModelConfig(name="x", engine="fake"))
    assert done == steps


class _FromConfig:
    started = staticmethod(lambda: None)

    def __init__(self, config: ModelConfig):
        self.config = config
        type(self).started()


class _Scripted(FakeEngine):
    """A fake whose engine splices as ``script`` says, whatever the stream sends."""

    def __init__(self, script: dict, **kwargs):
        super().__init__(controllers="splice", **kwargs)
        self.script = script

    def generate(self, request):
        controller = ControllerSpec(module="fake-splice", arg=json.dumps(self.script))
        return super().generate(msgspec.structs.replace(request, controller=controller))


def _raw(events):
    """An engine kind whose stream is exactly ``events``."""
    engine = FakeEngine(controllers="splice")

    async def stream(request, admitted):
        for event in events:
            yield event

    engine.engine.stream = stream  # type: ignore[method-assign]
    return engine


@pytest.mark.parametrize("events, what", [
    ([TokenEvent(token_id=1, text="x"), ForkEvent(index=0, parent=0)], "fork of choice 0 into"),
    ([TokenEvent(token_id=1, text="x"), BacktrackEvent(count=2)], "backtrack of 2 tokens"),
    ([TokenEvent(index=3, token_id=1, text="x")], "choice 3, which is not open"),
])
async def test_the_host_refuses_splices_that_break_the_contract(events, what):
    out = await _events(_raw(events), _request(splices="full"))
    assert out[-1].kind == "engine" and what in out[-1].message


async def test_a_deadline_reports_forced_and_sampled_tokens_of_spliced_choices():
    engine = _raw([TokenEvent(token_id=1, text="a", forced=True), TokenEvent(token_id=2, text="b"),
                   TokenEvent(token_id=3, text="c"), BacktrackEvent(count=1, text="c"),
                   ForkEvent(index=1, parent=0)])

    async def slow(request, admitted, inner=engine.engine.stream):
        async for event in inner(request, admitted):
            yield event
        await asyncio.sleep(10)

    engine.engine.stream = slow  # type: ignore[method-assign]
    request = msgspec.structs.replace(_request(splices="full"), timeout_s=0.2)
    finals = [e for e in await _events(engine, request) if isinstance(e, FinalEvent)]
    usages = {f.index: f.usage for f in finals}
    assert usages[0] == Usage(prompt_tokens=2, completion_tokens=2, forced_tokens=1,
                              sampled_tokens=2)
    assert usages[1] == Usage(prompt_tokens=2, completion_tokens=2, sampled_tokens=0)


async def test_openai_whole_response_folds_splices_before_echoing_the_prompt(client_for):
    # forced "ab", sampled "Hel", "l" withdrawn, "!" appended, then a fork of choice 0
    async with client_for(_Scripted({"ff": "ab", "backtrack": 1, "fork": 1})) as c:
        r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "echo": True})
    body = r.json()
    assert [c["text"] for c in body["choices"]] == ["HiabHe!", "HiabHe!"]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 10, "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0}}


async def test_a_backtrack_over_the_first_token_keeps_the_echo(client_for):
    async with client_for(_Scripted({"backtrack": 3})) as c:
        r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "echo": True})
    assert r.json()["choices"][0]["text"] == "Hi!"


async def test_a_stream_gets_the_splice_refusal_in_its_shape(client_for):
    async with client_for(_Scripted({"ff": "ab", "backtrack": 1})) as c:
        r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "abHel"
    assert chunks[-1]["error"]["param"] == "controller"
    assert "cannot show" in chunks[-1]["error"]["message"]


@pytest.fixture
def client_for():
    import httpx

    from gateway.config import GatewayConfig
    from gateway.ingress.asgi import create_app
    from gateway.ingress.registry import ModelRegistry

    def make(engine):
        app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig())
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")

    return make


async def test_closing_after_the_last_final_event_is_no_abort():
    engine = FakeEngine()
    stream = engine.generate(_request(rid="done", max_tokens=3, ignore_eos=True))
    async for event in stream:
        if isinstance(event, FinalEvent):
            break  # every choice has ended; the consumer stops before the stream does
    await stream.aclose()
    stats = await engine.stats()
    assert (stats.active, stats.aborted) == (0, 0)


def test_controllers_default_on_only_where_the_kind_runs_them(monkeypatch):
    from engines.kit.config import Controllers

    assert ModelConfig(name="v").controllers == Controllers()
    assert ModelConfig(name="p", engine="pipeline").controllers == Controllers()
    assert ModelConfig(name="off", controllers=None).controllers is None
    monkeypatch.setitem(ENGINE_KINDS, "plain", EngineKind(
        implementation="tests.unit.test_engine_host:_FromConfig", concurrency_arg="batch",
        default_concurrency=1))
    assert ModelConfig(name="n", engine="plain").controllers is None
    with pytest.raises(ValueError, match="the plain engine runs no controllers"):
        ModelConfig(name="n", engine="plain", controllers=Controllers())

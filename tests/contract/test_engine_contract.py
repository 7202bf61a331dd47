"""The engine contract (``contract``), checked the same way for every engine kind.

Each test runs against the fake kind (in process, behind the real ``EngineHost``) and against
real vLLM and the pipeline kind through their Ray Serve deployments and the ingress's
``ServeEngineClient`` (over the engine channel, and once over Ray objects). A new engine kind
joins by adding a parameter to ``engine``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from contract import (
    ControllerSpec,
    ErrorEvent,
    Event,
    FinalEvent,
    GenerateRequest,
    ModelInfo,
    OutputOptions,
    PromptEvent,
    Sampling,
    TextPrompt,
    TokenEvent,
    TokenPrompt,
)
from contract.client import EngineClient
from tests.fake_engine import FakeEngine


@dataclass
class Kind:
    name: str
    client: EngineClient
    info: ModelInfo
    deadline_s: float  # shorter than the long request below takes on this kind


@pytest.fixture(params=["fake", pytest.param("vllm", marks=pytest.mark.e2e),
                        pytest.param("vllm-over-ray", marks=pytest.mark.e2e),
                        pytest.param("pipeline", marks=pytest.mark.e2e)])
async def engine(request) -> AsyncIterator[Kind]:
    """One client per engine kind: a new kind adds a parameter and a branch here. Serve kinds
    stream over the ingress's channel (the default); ``vllm-over-ray`` as Ray objects."""
    from engines.channel import ChannelReceiver
    from gateway.ingress.engine_client import ServeEngineClient

    receiver = ChannelReceiver()
    if request.param == "fake":
        client: EngineClient = FakeEngine(delay=0.02)
        deadline = 0.3
    elif request.param == "vllm":  # the session's Ray Serve deployment (tests/serve_session.py)
        client = ServeEngineClient(request.getfixturevalue("engine_handle"), channel=receiver)
        deadline = 1.0
    elif request.param == "vllm-over-ray":
        client = ServeEngineClient(request.getfixturevalue("engine_handle"))
        deadline = 1.0
    elif request.param == "pipeline":  # the embedded model split over 2 Ray stage actors
        client = ServeEngineClient(request.getfixturevalue("pipeline_handle"), channel=receiver)
        deadline = 1.0
    else:
        raise AssertionError(f"no client for engine kind {request.param}")
    kind = request.param.removesuffix("-over-ray")  # the same kind, another transport
    yield Kind(kind, client, await client.model_info(), deadline)
    await receiver.close()


def _request(rid: str, prompt=None, **kwargs) -> GenerateRequest:
    sampling = kwargs.pop("sampling", Sampling(temperature=0, max_tokens=4))
    return GenerateRequest(request_id=f"contract-{rid}-{time.monotonic_ns()}", model="m",
                           prompt=prompt or TextPrompt(text="The capital of France is"),
                           sampling=sampling, **kwargs)


def _long(kind: Kind, rid: str, **kwargs) -> GenerateRequest:
    """A request that runs well past the kind's deadline_s unless stopped."""
    room = kind.info.max_model_len - 8
    return _request(rid, TextPrompt(text="Count:"),
                    sampling=Sampling(temperature=0, max_tokens=min(room, 1500), ignore_eos=True),
                    **kwargs)


async def _all(events: AsyncIterator[Event]) -> list[Event]:
    return [event async for event in events]


async def _settled(client: EngineClient, aborted: int) -> tuple[int, int]:
    """(active, aborted) once nothing is in flight and ``aborted`` was reached (or 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        stats = await client.stats()
        if (stats.active == 0 and stats.aborted >= aborted) or time.monotonic() > deadline:
            return stats.active, stats.aborted
        await asyncio.sleep(0.05)


async def test_model_info_names_the_kind_and_its_capabilities(engine):
    info = engine.info
    assert info.engine == engine.name and info.max_model_len > 1 and info.vocab_size > 1
    assert info.capabilities.max_n >= 1 and info.dtype


async def test_ordering_rules_of_the_stream(engine):
    request = _request("order", sampling=Sampling(temperature=1.0, seed=7, n=2, max_tokens=6,
                                                  ignore_eos=True),
                       output=OutputOptions(prompt_logprobs=0, logprobs=1))
    events = await _all(engine.client.generate(request))
    assert isinstance(events[0], PromptEvent)
    assert not any(isinstance(e, PromptEvent) for e in events[1:])
    assert [t.token_id for t in events[0].tokens] == list(
        await engine.client.tokenize(request.prompt))
    finals = [e for e in events if isinstance(e, FinalEvent)]
    assert sorted(f.index for f in finals) == [0, 1]  # exactly one per choice
    assert isinstance(events[-1], FinalEvent)  # the stream ends with the last choice's final
    for final in finals:
        position = events.index(final)
        tokens = [e for e in events if isinstance(e, TokenEvent) and e.index == final.index]
        assert all(events.index(t) < position for t in tokens)  # nothing after a final
        assert len(tokens) == final.usage.completion_tokens == 6
        assert final.finish_reason == "length"
        assert all(t.logprob is not None and len(t.top_logprobs) >= 1 for t in tokens)
        flagged = [t for t in tokens if t.last]
        assert flagged in ([], [tokens[-1]])  # `last` only ever on the final token


async def test_greedy_requests_are_deterministic(engine):
    first = await _all(engine.client.generate(_request("det1")))
    second = await _all(engine.client.generate(_request("det2")))
    assert [e.token_id for e in first if isinstance(e, TokenEvent)] == [
        e.token_id for e in second if isinstance(e, TokenEvent)]


async def test_closing_the_stream_aborts_the_request(engine):
    before = (await engine.client.stats()).aborted
    stream = engine.client.generate(_long(engine, "abort"))
    seen = [await anext(stream) for _ in range(3)]
    assert all(isinstance(e, TokenEvent) for e in seen)
    await stream.aclose()
    assert await _settled(engine.client, before + 1) == (0, before + 1)


async def test_deadline_ends_every_choice_with_abort(engine):
    events = await _all(engine.client.generate(_long(engine, "deadline",
                                                     timeout_s=engine.deadline_s)))
    final = events[-1]
    assert isinstance(final, FinalEvent)
    assert (final.finish_reason, final.stop_reason) == ("abort", "timeout")
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert 0 < len(tokens) < _long(engine, "x").sampling.max_tokens
    assert final.usage.completion_tokens == len(tokens)
    assert (await engine.client.stats()).active == 0


def _refusals(info: ModelInfo) -> list[tuple[str, GenerateRequest]]:
    """(param the error must name, request) for what admission refuses on every kind."""
    limit, vocab = info.max_model_len, info.vocab_size
    caps = info.capabilities
    return [
        ("prompt", _request("empty", TokenPrompt(token_ids=()))),
        ("prompt", _request("oov", TokenPrompt(token_ids=(1, vocab)))),
        ("prompt", _request("long", TokenPrompt(token_ids=(1,) * limit))),
        ("max_tokens", _request("room", sampling=Sampling(max_tokens=limit))),
        ("logit_bias", _request("bias", sampling=Sampling(logit_bias={vocab: 1.0}))),
        ("stop_token_ids", _request("stops", sampling=Sampling(stop_token_ids=(vocab + 5,)))),
        ("logprobs", _request("lp", output=OutputOptions(logprobs=(caps.max_logprobs or 0) + 1))),
        ("n", _request("n", sampling=Sampling(n=caps.max_n + 1, max_tokens=2))),
        # no kind runs a controller it does not know (kinds without controllers: none at all)
        ("controller", _request("ctl", controller=ControllerSpec(module="no-such-controller"))),
    ]


@pytest.mark.parametrize("case", range(9))
async def test_refusals_are_one_validation_error_event(engine, case):
    param, request = _refusals(engine.info)[case]
    events = await _all(engine.client.generate(request))
    assert len(events) == 1 and isinstance(events[0], ErrorEvent), events
    assert events[0].kind == "validation" and events[0].param == param
    assert events[0].message


# An llguidance grammar with forced text then a free part; the same on every kind.
GRAMMAR = ControllerSpec(module="llguidance", arg=json.dumps(
    {"grammar": {"grammars": [{"lark_grammar": 'start: "Paris is " /[a-z]{3,8}/'}]}}))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_grammar_holds_on_every_kind_that_runs_controllers(engine, temperature):
    """A kind that runs controllers (the real ones: vLLM, the pipeline) writes what the
    grammar admits, forced text included, greedy or sampled, and ends where the grammar ends
    (its EOS); one that runs none (the fake here) refuses the request as a validation error
    naming ``controller``."""
    request = _request("grammar", controller=GRAMMAR, sampling=Sampling(
        temperature=temperature, seed=3, max_tokens=16))
    events = await _all(engine.client.generate(request))
    if engine.info.capabilities.controllers == "none":
        assert engine.name == "fake", "a real engine kind runs controllers"
        assert len(events) == 1 and isinstance(events[0], ErrorEvent), events
        assert events[0].kind == "validation" and events[0].param == "controller"
        return
    finals = [e for e in events if isinstance(e, FinalEvent)]
    assert len(finals) == 1 and events[-1] is finals[0], events
    text = "".join(e.text for e in events if isinstance(e, TokenEvent)) + finals[0].text
    assert re.fullmatch(r"Paris is [a-z]{3,8}", text), text
    assert finals[0].finish_reason == "eos", finals[0]


async def test_a_controlled_request_asking_for_two_choices_is_refused(engine):
    """Controllers fork instead of ``n`` (docs/controllers.md): a kind that runs them names
    ``n``; one that runs none names ``controller``."""
    request = _request("grammar-n", controller=GRAMMAR,
                       sampling=Sampling(temperature=1.0, n=2, max_tokens=8))
    events = await _all(engine.client.generate(request))
    assert len(events) == 1 and isinstance(events[0], ErrorEvent), events
    none = engine.info.capabilities.controllers == "none"
    assert events[0].kind == "validation" and events[0].param == ("controller" if none else "n")


async def test_tokenize_detokenize_round_trip(engine):
    text = "Hello world, again."
    ids = await engine.client.tokenize(TextPrompt(text=text, add_special_tokens=False))
    assert ids and all(isinstance(t, int) for t in ids)
    assert await engine.client.detokenize(ids) == text


async def test_health_and_stats(engine):
    await engine.client.check_health()
    stats = await engine.client.stats()
    assert stats.active == 0 and stats.aborted >= 0

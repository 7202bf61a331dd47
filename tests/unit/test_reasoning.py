"""Reasoning output (docs/reasoning.md) over the fake engine: the host's split of thinking from
the answer with vLLM's own ``deepseek_r1`` parser, budgets and the ``reasoning`` controller,
and every protocol's rendering read by its real client (openai and anthropic SDKs)."""

from __future__ import annotations

import json

import anthropic
import httpx
import httpx2
import numpy as np
import openai
import pytest

from contract import (
    ChatMessage,
    ChatPrompt,
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    ReasoningOptions,
    TextPrompt,
    TokenEvent,
)
from engines.controllers.api.base import ControllerContext, ControllerError, Variables
from engines.controllers.runtime.reasoning import ReasoningController
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from tests.controllers import FakeTokenizer, Scripted
from tests.fake_engine import MARKERS, REASONING_REPLY, FakeEngine
from tests.fake_engine import FakeTokenizer as CharTokenizer

pytestmark = pytest.mark.usefixtures("long_context")

THOUGHT, ANSWER = "Two and two.", "Four"
END = MARKERS["</think>"]
ASK = [{"role": "user", "content": "2+2?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _engine(reply: str = REASONING_REPLY, controllers: str = "splice") -> FakeEngine:
    return FakeEngine(reply=reply, controllers=controllers, reasoning=True)


def _chat(budget: int | None = None, content: str = "2+2?") -> GenerateRequest:
    return GenerateRequest(request_id="r", model="fake-model", prompt=ChatPrompt(
        messages=(ChatMessage(role="user", content=content),)),
        reasoning=None if budget is None else ReasoningOptions(max_tokens=budget))


async def _events(engine: FakeEngine, request: GenerateRequest) -> list:
    return [event async for event in engine.generate(request)]


def _texts(events: list) -> tuple[str, str]:
    parts = [e for e in events if isinstance(e, TokenEvent | FinalEvent)]
    return "".join(e.reasoning for e in parts), "".join(e.text for e in parts)


# --- the engine host -------------------------------------------------------------------------


async def test_the_host_keeps_thinking_apart_and_counts_its_tokens():
    engine = _engine()
    events = await _events(engine, _chat())
    assert _texts(events) == (THOUGHT, ANSWER)
    final = events[-1]
    assert final.usage.reasoning_tokens == len(THOUGHT) + 1  # the marker counts as thinking
    assert final.usage.completion_tokens == len(THOUGHT) + 1 + len(ANSWER) + 1  # and EOS
    assert (await engine.model_info()).reasoning == "deepseek_r1"
    assert engine.requests[-1].controller is None  # no budget, no controller: not steered


async def test_a_budget_runs_under_the_reasoning_controller_and_ends_the_thinking():
    engine = _engine()
    seen = []
    original = engine.model.stream

    def stream(request, admitted):
        seen.append(request)
        return original(request, admitted)

    engine.model.stream = stream
    events = await _events(engine, _chat(budget=3))
    assert _texts(events) == (THOUGHT[:3], ANSWER)
    assert events[-1].usage.reasoning_tokens == 4
    steered = seen[-1].controller
    assert steered.module == "reasoning"
    assert json.loads(steered.arg) == {"end": [END], "budget": 3, "inner": None}


async def test_a_budget_on_a_model_without_controllers_is_refused():
    events = await _events(_engine(controllers="none"), _chat(budget=3))
    assert len(events) == 1 and isinstance(events[0], ErrorEvent)
    assert events[0].kind == "validation" and events[0].param == "reasoning"


async def test_a_prompt_that_closed_the_reasoning_is_answer_only():
    engine = _engine(reply="Four")
    request = GenerateRequest(request_id="r", model="fake-model",
                              prompt=TextPrompt(text="Q<think></think>"))
    events = await _events(engine, request)
    assert _texts(events) == ("", "Four") and events[-1].usage.reasoning_tokens == 0


async def test_text_a_detokenizer_held_back_is_split_where_it_lands():
    """vLLM may put several tokens' text on the last of them (a busy consumer): the split
    reads the marker inside the merged text."""
    from engines.replica.reasoning import ReasoningFormat

    tokens = [ord("T"), ord("w"), END, ord("F"), ord("o")]
    texts = ["", "", "", "Tw</think>F", "o"]

    async def stream():
        for token, text in zip(tokens, texts, strict=True):
            yield TokenEvent(token_id=token, text=text)
        yield FinalEvent(finish_reason="length", usage=_usage(len(tokens)))

    fmt = ReasoningFormat("deepseek_r1", CharTokenizer())
    events = [event async for event in fmt.split(stream())]
    assert _texts(events) == ("Tw", "Fo") and events[-1].usage.reasoning_tokens == 3


def _usage(tokens: int):
    from contract import Usage

    return Usage(prompt_tokens=1, completion_tokens=tokens)


# --- the reasoning controller ----------------------------------------------------------------


def _controller(budget, inner=None, end=(60, 61)) -> ReasoningController:
    registry = {"scripted": Scripted}
    ctx = ControllerContext(FakeTokenizer(), Variables(), registry.get)
    arg = {"end": list(end), "budget": budget,
           "inner": None if inner is None else {"module": "scripted", "arg": inner}}
    return ReasoningController(ctx, json.dumps(arg), [1, 2])


def test_the_controller_forces_the_marker_when_the_budget_is_spent():
    ctrl = _controller(budget=2)
    assert ctrl.pre_process().ff_tokens == [] and ctrl.mid_process() is None
    ctrl.post_process([5], 0)
    ctrl.post_process([6], 0)
    assert ctrl.pre_process().ff_tokens == [60, 61]
    ctrl.post_process([60, 61], 0)
    assert not ctrl.thinking and ctrl.pre_process().ff_tokens == []


def test_the_inner_controller_starts_after_the_marker_and_eos_waits_for_it():
    ctrl = _controller(budget=None, inner="allow=5")
    allowed = ctrl.mid_process()
    assert allowed is not None and not allowed[0] and allowed[1:].all()  # no EOS while thinking
    assert ctrl.post_process([7, 60], 0) is False and ctrl.thinking
    ctrl.post_process([61, 9], 0)  # the marker ends; token 9 is the answer's first
    assert not ctrl.thinking and ctrl.inner.seen == [9]
    assert ctrl.inner.prompt == [1, 2, 7, 60, 61]
    assert np.flatnonzero(ctrl.mid_process()).tolist() == [5]  # the inner's mask from now on


def test_a_wrong_inner_controller_is_refused_before_any_thinking():
    with pytest.raises(ControllerError, match="unknown controller"):
        ReasoningController(ControllerContext(FakeTokenizer(), Variables()),
                            json.dumps({"end": [60], "inner": {"module": "nope"}}), [])
    with pytest.raises(ControllerError, match="bad program"):
        _controller(budget=None, inner="bad")


# --- protocols, read by their clients --------------------------------------------------------


def _http(engine: FakeEngine, base: str = "http://gw/v1") -> httpx.AsyncClient:
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base)


def _openai(engine: FakeEngine) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x", http_client=_http(engine),
                              max_retries=0)


async def test_openai_chat_whole_and_streamed():
    client = _openai(_engine())
    whole = await client.chat.completions.create(model="fake-model", messages=ASK)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)
    assert message.model_extra["reasoning"] == THOUGHT  # vLLM's name too
    assert whole.usage.completion_tokens_details.reasoning_tokens == len(THOUGHT) + 1
    stream = await client.chat.completions.create(model="fake-model", messages=ASK, stream=True,
                                                  stream_options={"include_usage": True})
    thought, answer, usage = "", "", None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            thought += getattr(choice.delta, "reasoning_content", None) or ""
            answer += choice.delta.content or ""
    assert (thought, answer) == (THOUGHT, ANSWER)
    assert usage.completion_tokens_details.reasoning_tokens == len(THOUGHT) + 1


async def test_openai_budget_history_and_include_reasoning():
    engine = _engine()
    client = _openai(engine)
    history = [*ASK, {"role": "assistant", "content": "4", "reasoning_content": "sum"}, *ASK]
    whole = await client.chat.completions.create(
        model="fake-model", messages=history, extra_body={"thinking_token_budget": 3})
    assert whole.choices[0].message.reasoning_content == THOUGHT[:3]
    assert engine.requests[-1].reasoning == ReasoningOptions(max_tokens=3)
    assert [m.content for m in engine.requests[-1].prompt.messages] == ["2+2?", "4", "2+2?"]
    hidden = await client.chat.completions.create(
        model="fake-model", messages=ASK, extra_body={"include_reasoning": False})
    assert hidden.choices[0].message.content == ANSWER
    assert "reasoning_content" not in (hidden.choices[0].message.model_extra or {})
    with pytest.raises(openai.BadRequestError, match="not both"):
        await client.chat.completions.create(model="fake-model", messages=ASK, extra_body={
            "thinking_token_budget": 3, "max_reasoning_tokens": 3})
    with pytest.raises(openai.BadRequestError, match=">= 0"):
        await client.chat.completions.create(model="fake-model", messages=ASK, extra_body={
            "max_reasoning_tokens": -1})


async def test_openai_a_tool_call_after_the_thinking():
    client = _openai(_engine(reply=f"Weather tool.</think>{CALL}"))
    whole = await client.chat.completions.create(
        model="fake-model", messages=ASK, tools=[{"type": "function", "function": WEATHER}],
        tool_choice="required")
    message = whole.choices[0].message
    assert message.reasoning_content == "Weather tool."
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert whole.choices[0].finish_reason == "tool_calls"


async def test_responses_reasoning_item_whole_and_streamed():
    engine = _engine()
    client = _openai(engine)
    whole = await client.responses.create(model="fake-model", input="2+2?")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == THOUGHT and whole.output_text == ANSWER
    assert whole.usage.output_tokens_details.reasoning_tokens == len(THOUGHT) + 1
    async with client.responses.stream(model="fake-model", input="2+2?",
                                       reasoning={"max_tokens": 3}) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert streamed.output[0].content[0].text == THOUGHT[:3]
    assert streamed.output_text == ANSWER
    assert engine.requests[-1].reasoning == ReasoningOptions(max_tokens=3)


def _anthropic(engine: FakeEngine) -> anthropic.AsyncAnthropic:
    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig())
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw")
    return anthropic.AsyncAnthropic(base_url="http://gw", api_key="x", http_client=http,
                                    max_retries=0)


async def test_anthropic_thinking_blocks_whole_and_streamed():
    engine = _engine()
    client = _anthropic(engine)
    thinking = {"type": "enabled", "budget_tokens": 3}
    whole = await client.messages.create(model="fake-model", max_tokens=50, messages=ASK,
                                         thinking=thinking)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == THOUGHT[:3] and whole.content[0].signature
    assert whole.content[1].text == ANSWER
    assert engine.requests[-1].reasoning == ReasoningOptions(max_tokens=3)
    async with client.messages.stream(model="fake-model", max_tokens=50, messages=ASK,
                                      thinking=thinking) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert "thinking" in kinds and "signature" in kinds
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert streamed.content[0].thinking == THOUGHT[:3]
    assert streamed.content[0].signature == whole.content[0].signature
    plain = await client.messages.create(model="fake-model", max_tokens=50, messages=ASK)
    assert [(b.type, b.text) for b in plain.content] == [("text", ANSWER)]


async def test_thinking_turned_off_in_the_template_answers_at_once():
    """``chat_template_kwargs`` (vLLM's) reach the template; Anthropic without ``thinking``
    turns it off as Qwen3's template reads it (the fake model renders it the same way)."""
    engine = _engine()
    client = _openai(engine)
    off = await client.chat.completions.create(
        model="fake-model", messages=ASK, max_tokens=50,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = off.choices[0].message
    assert (getattr(message, "reasoning_content", None), message.content) == (None, ANSWER)
    details = off.usage.completion_tokens_details  # reported when there was thinking
    assert details is None or details.reasoning_tokens == 0
    assert engine.requests[-1].prompt.template_kwargs == {"enable_thinking": False}
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="fake-model", messages=ASK, max_tokens=5,
            extra_body={"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})
    assert refused.value.body["param"] == "chat_template_kwargs"
    claude = _anthropic(engine)
    plain = await claude.messages.create(model="fake-model", max_tokens=50, messages=ASK)
    assert [(b.type, b.text) for b in plain.content] == [("text", ANSWER)]
    assert engine.requests[-1].prompt.template_kwargs == {"enable_thinking": False}
    await claude.messages.create(model="fake-model", max_tokens=50, messages=ASK,
                                 thinking={"type": "adaptive"})
    assert engine.requests[-1].prompt.template_kwargs == {}


def test_template_kwargs_render_and_the_reserved_ones_are_refused():
    from transformers import AutoTokenizer

    from engines.kit.base import PromptError
    from engines.kit.embedded import local_model_dir
    from engines.kit.tokens import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(local_model_dir("embedded:smollm2-135m-instruct"))
    tokenizer.chat_template = "{{ messages[0]['content'] }}{% if shout %}!{% endif %}"
    asked = ChatPrompt(messages=(ChatMessage(role="user", content="hi"),),
                       template_kwargs={"shout": True})
    assert tokenizer.decode(render_prompt(tokenizer, asked)) == "hi!"
    with pytest.raises(PromptError, match="add_generation_prompt"):
        render_prompt(tokenizer, ChatPrompt(messages=asked.messages,
                                            template_kwargs={"add_generation_prompt": False}))


async def test_anthropic_thinking_rules_and_history():
    client = _anthropic(_engine())
    with pytest.raises(anthropic.BadRequestError, match="less than max_tokens"):
        await client.messages.create(model="fake-model", max_tokens=10, messages=ASK,
                                     thinking={"type": "enabled", "budget_tokens": 10})
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        await client.messages.create(model="fake-model", max_tokens=10, messages=ASK,
                                     thinking={"type": "enabled"})
    turn = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "sum", "signature": "x"},
        {"type": "text", "text": "4"}]}
    again = await client.messages.create(model="fake-model", max_tokens=50,
                                         messages=[*ASK, turn, *ASK],
                                         thinking={"type": "adaptive"})
    assert [b.type for b in again.content] == ["thinking", "text"]


async def test_text_protocols_get_the_answer_only():
    """TGI's generate (and the other text protocols) render ``text`` alone."""
    async with _http(_engine(), base="http://gw") as http:
        r = await http.post("/generate", json={"inputs": "<|im_start|>user\n2+2?<think>",
                                               "parameters": {"max_new_tokens": 40}})
    assert r.status_code == 200 and r.json()["generated_text"] == ANSWER


async def test_thinking_tokens_are_counted_in_the_engines_metrics(recorded, monkeypatch):
    from engines.kit.telemetry import EngineMetrics
    from engines.replica import host

    metrics = EngineMetrics(recorded, recorded.keeper)
    monkeypatch.setattr(host, "engine_metrics", lambda: metrics)
    await _events(_engine(), _chat())
    await _events(_engine(), _chat(budget=3))
    tags = (("engine", "fake"), ("model", "fake-model"))
    assert recorded.counts["llm_gateway_reasoning_tokens"][tags] == len(THOUGHT) + 1 + 4

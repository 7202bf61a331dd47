"""Reasoning output end to end (docs/reasoning.md): a tiny random Llama whose tokenizer has
``<think>`` / ``</think>`` and whose chat template opens a think block (``tests/
reasoning_models.py``), served by vLLM with the ``deepseek_r1`` parser, read by the openai and
anthropic SDKs through Ray Serve.

The random model never closes its thinking on its own: a request's reasoning budget makes the
``reasoning`` controller force ``</think>``, so the split point is known. Oracle: vLLM's own
greedy output (``reference_greedy``, no gateway code): the first ``BUDGET`` tokens after the
prompt are the thinking, and the answer is vLLM's continuation of prompt + thinking + marker.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import jsonschema
import msgspec
import openai
import pytest

from engines.kit.config import ModelConfig, Reasoning
from engines.kit.embedded import local_model_dir
from gateway.config import GatewayConfig
from gateway.model_routes import model_route
from tests.e2e.conftest import MODEL
from tests.pipeline_models import build_tiny
from tests.reasoning_models import make_reasoning_tokenizer
from tests.serve_session import VLLM_TEST_ARGS, _wait_healthy

pytestmark = pytest.mark.e2e

TINY, MODEL_APP, APP, ROUTE = "tiny-thinker", "thinker-model", "thinker", "/thinker"
BUDGET, MAX_TOKENS = 6, 20
ASK = [{"role": "user", "content": "What is two and two?"}]
# Closed choices: a random model would fill a free string or number until max_tokens.
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
           "required": ["city"], "additionalProperties": False}
ENGINE_ARGS = {**VLLM_TEST_ARGS, "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("thinker")
    return make_reasoning_tokenizer(build_tiny(
        "llama-wide", root / "llama", Path(local_model_dir(f"embedded:{MODEL}") or "")))


@pytest.fixture(scope="module")
def thinker(gateway_url, source):
    from ray import serve

    from gateway.app import build_app, build_model_app

    model = ModelConfig(name=TINY, source=str(source), num_cpus=0.05, engine_args=ENGINE_ARGS,
                        reasoning=Reasoning(parser="deepseek_r1"))
    serve.run(build_model_app({"model": msgspec.to_builtins(model)}), name=MODEL_APP,
              route_prefix=model_route(TINY))
    config = GatewayConfig(models=[msgspec.structs.replace(model, app=MODEL_APP)],
                           ingress_num_cpus=0.05)
    serve.run(build_app(config), name=APP, route_prefix=ROUTE)
    _wait_healthy(f"{gateway_url}{ROUTE}", "the reasoning model's gateway")
    handle = serve.get_deployment_handle(f"engine-{TINY}", app_name=MODEL_APP)
    yield f"{gateway_url}{ROUTE}", handle
    serve.delete(APP)
    serve.delete(MODEL_APP)


@pytest.fixture(scope="module")
def oracle(thinker):
    """vLLM's own greedy thinking (``BUDGET`` tokens) and answer after the forced marker."""
    url, handle = thinker
    prompt = httpx.post(f"{url}/tokenize", json={"model": TINY, "messages": ASK},
                        timeout=60).json()["tokens"]
    thought = handle.reference_greedy.remote(prompt, BUDGET).result()
    end = httpx.post(f"{url}/tokenize", json={"model": TINY, "prompt": "</think>",
                                             "add_special_tokens": False}).json()["tokens"]
    assert len(thought.token_ids) == BUDGET and end[0] not in thought.token_ids
    answer = handle.reference_greedy.remote(prompt + thought.token_ids + end,
                                            MAX_TOKENS - BUDGET - len(end)).result()
    return thought.text, answer.text


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def _greedy(**extra) -> dict:
    return {"model": TINY, "messages": ASK, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def test_openai_chat_whole_and_streamed_split_where_the_budget_ended_the_thinking(
        thinker, oracle):
    client = _openai(thinker[0])
    budget = {"thinking_token_budget": BUDGET}
    whole = client.chat.completions.create(**_greedy(), extra_body=budget)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == oracle
    assert whole.usage.completion_tokens_details.reasoning_tokens == BUDGET + 1
    stream = client.chat.completions.create(**_greedy(stream=True), extra_body=budget)
    thought, answer = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            thought += getattr(choice.delta, "reasoning_content", None) or ""
            answer += choice.delta.content or ""
    assert (thought, answer) == oracle


def test_without_a_budget_the_thinking_runs_to_max_tokens(thinker, oracle):
    """No controller: the split alone, over vLLM's plain stream (the random model never
    writes ``</think>``)."""
    whole = _openai(thinker[0]).chat.completions.create(**_greedy(max_tokens=BUDGET))
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (oracle[0], "")
    assert whole.usage.completion_tokens_details.reasoning_tokens == BUDGET


def test_responses_and_anthropic_read_the_same_thinking(thinker, oracle):
    url = thinker[0]
    response = _openai(url).responses.create(model=TINY, input=ASK, temperature=0,
                                             max_output_tokens=MAX_TOKENS,
                                             reasoning={"max_tokens": BUDGET})
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert (response.output[0].content[0].text, response.output_text) == oracle
    assert response.usage.output_tokens_details.reasoning_tokens == BUDGET + 1
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    with client.messages.stream(model=TINY, max_tokens=MAX_TOKENS, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": BUDGET},
                                extra_body={"temperature": 0}) as stream:  # greedy
        message = stream.get_final_message()
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == oracle


def _thought_with(handle, body: dict) -> str:
    """vLLM's greedy thinking for the prompt this chat body renders to (tools change it)."""
    from protocols.openai.schemas import ChatCompletionRequest
    from protocols.openai.translate import chat_request

    request, _ = chat_request(msgspec.convert(body, ChatCompletionRequest), TINY, "oracle")
    prompt = list(handle.tokenize.remote(request.prompt).result())
    return handle.reference_greedy.remote(prompt, BUDGET).result().text


def test_a_tool_call_after_the_thinking_validates(thinker):
    url, handle = thinker
    body = _greedy(max_tokens=80, tool_choice="required", tools=[
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}])
    whole = _openai(url).chat.completions.create(
        **body, extra_body={"thinking_token_budget": BUDGET})
    message = whole.choices[0].message
    # Nothing is masked while it thinks (but EOS), and the grammar begins after the marker.
    assert message.reasoning_content == _thought_with(handle, body)
    assert whole.usage.completion_tokens_details.reasoning_tokens == BUDGET + 1
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), WEATHER)


def test_a_json_schema_answer_after_the_thinking_validates(thinker, oracle):
    # Compact JSON (llguidance's schema option): a random model would fill free whitespace.
    schema = {"type": "object", "properties": {"answer": {"enum": [3, 4, 5]}},
              "required": ["answer"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}
    whole = _openai(thinker[0]).chat.completions.create(
        **_greedy(max_tokens=80), extra_body={"thinking_token_budget": BUDGET},
        response_format={"type": "json_schema",
                         "json_schema": {"name": "sum", "schema": schema}})
    message = whole.choices[0].message
    assert message.reasoning_content == oracle[0]
    jsonschema.validate(json.loads(message.content), schema)


def test_thinking_turned_off_by_the_template_answers_at_once(thinker, source):
    """Qwen3's switch: ``chat_template_kwargs: {"enable_thinking": false}`` (and Anthropic
    without ``thinking``) makes the template close the think block, so the whole output is the
    answer. Oracle: the tokenizer's own template (transformers) and vLLM's greedy output."""
    from transformers import AutoTokenizer

    url, handle = thinker
    tokenizer = AutoTokenizer.from_pretrained(source)
    text = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    prompt = tokenizer.encode(text, add_special_tokens=False)
    answer = handle.reference_greedy.remote(prompt, MAX_TOKENS).result().text
    whole = _openai(url).chat.completions.create(
        **_greedy(), extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = whole.choices[0].message
    assert (getattr(message, "reasoning_content", None), message.content) == (None, answer)
    assert whole.usage.prompt_tokens == len(prompt)
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    plain = client.messages.create(model=TINY, max_tokens=MAX_TOKENS, messages=ASK,
                                   extra_body={"temperature": 0})
    assert [(b.type, b.text) for b in plain.content] == [("text", answer)]


def test_bad_reasoning_inputs_answer_in_each_protocols_shape(thinker):
    """Refused before the engine runs: a 400 in OpenAI's shape naming the parameter, and in
    Anthropic's (``invalid_request_error``), through Ray Serve."""
    client = _openai(thinker[0])
    bad = [({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
           ({"thinking_token_budget": -1}, "thinking_token_budget"),
           ({"thinking_token_budget": 2, "max_reasoning_tokens": 2}, "max_reasoning_tokens")]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**_greedy(), extra_body=body)
        assert refused.value.body["param"] == param, refused.value.body
    claude = anthropic.Anthropic(base_url=thinker[0], api_key="x", max_retries=0, timeout=120)
    for thinking in ({"type": "enabled", "budget_tokens": MAX_TOKENS}, {"type": "enabled"},
                     {"type": "sometimes"}):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model=TINY, max_tokens=MAX_TOKENS, messages=ASK,
                                   thinking=thinking)
        assert refused.value.body["error"]["type"] == "invalid_request_error"
        assert "thinking" in refused.value.body["error"]["message"]

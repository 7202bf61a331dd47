"""Tools in the prompt (engines/kit/tool_prompts.py, through engines.kit.tokens.render_prompt) with the
embedded model's real tokenizer: its own template knows no tools (the written fallback), and
the same tokenizer with a template that reads ``tools`` renders them its own way."""

from __future__ import annotations

import copy

import pytest

from contract import ChatMessage, ChatPrompt, ToolCall, ToolDefinition
from engines.kit.tokens import render_prompt

WEATHER = ToolDefinition(name="get_weather", description="Weather now",
                         parameters='{"type": "object", "properties": {"city": {"type": "string"}}}')
HISTORY = (
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content="Weather in Paris and Rome?"),
    ChatMessage(role="assistant", content="", tool_calls=(
        ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}'),
        ToolCall(id="c2", name="get_weather", arguments='{"city": "Rome"}'))),
    ChatMessage(role="tool", content="sunny", tool_call_id="c1", name="get_weather"),
    ChatMessage(role="tool", content="rain", tool_call_id="c2", name="get_weather"),
)
# A template in the style of Hugging Face's tool-calling ones (it reads `tools`).
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}[{{ t.function.name }}]{% endfor %}|{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}{% if m.role == 'tool' %} (for {{ m.tool_call_id }}){% endif %}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engines.kit.embedded import prepare_embedded_model
    return AutoTokenizer.from_pretrained(str(prepare_embedded_model(progress=False)))


def _text(tokenizer, prompt: ChatPrompt) -> str:
    return tokenizer.decode(render_prompt(tokenizer, prompt))


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer):
    text = _text(tokenizer, ChatPrompt(messages=HISTORY, tools=(WEATHER,)))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    assert '{"name": "get_weather", "description": "Weather now", "parameters": ' in system
    assert "<tool_call>" in system  # the instruction shows the markup
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Rome"}}\n</tool_call><|im_end|>') in text
    # Both results in one user turn, so user and assistant still alternate.
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
            "</tool_response><|im_end|>") in text
    assert text.endswith("<|im_start|>assistant\n")


def test_without_a_system_message_one_is_added_for_the_tools(tokenizer):
    text = _text(tokenizer, ChatPrompt(messages=HISTORY[1:2], tools=(WEATHER,)))
    assert text.startswith("<|im_start|>system\nYou may call the functions below")
    assert "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>" in text


def test_plain_chat_renders_as_before(tokenizer):
    prompt = ChatPrompt(messages=HISTORY[:2])
    expected = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in HISTORY[:2]],
        add_generation_prompt=True, tokenize=False)
    assert _text(tokenizer, prompt) == expected


def test_a_template_that_reads_tools_renders_them_its_own_way(tokenizer):
    native = copy.copy(tokenizer)
    native.chat_template = TOOLS_TEMPLATE
    text = _text(native, ChatPrompt(messages=HISTORY, tools=(WEATHER,)))
    assert text.startswith("TOOLS:[get_weather]|<system>Be brief.|")
    assert 'CALL get_weather {"city": "Paris"}CALL get_weather {"city": "Rome"}' in text
    assert "<tool>sunny (for c1)|<tool>rain (for c2)|<assistant>" in text
    assert "<tool_call>" not in text

"""OpenAI (and vLLM-extension) request bodies, as tolerant msgspec Structs.

Unknown top-level fields are ignored, as vLLM does: SDKs and the benchmark add fields freely.
Types are checked here; ranges and cross-field rules are checked in ``translate``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

__all__ = [
    "ChatCompletionRequest",
    "ChatMessageIn",
    "CompletionRequest",
    "DetokenizeRequest",
    "ToolCallIn",
    "ToolIn",
    "StreamOptions",
    "TokenizeRequest",
]


# Integers the engines carry as 64-bit (vLLM's msgpack to its engine core): larger JSON integers
# are refused here, as a 400 naming the field, instead of failing inside the engine.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    best_of: int | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: Int64 = 0
    prompt_logprobs: int | None = None
    # AICI-style controllers (docs/controllers.md): a tag and its argument
    controller: str | None = None
    controller_arg: str | dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # msgspec allows one array-like type per union, so list shapes are checked in translate.
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCallIn
    type: str = "function"


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool message's
    # An assistant's earlier thinking, as DeepSeek's and vLLM's answers carried it: accepted
    # and left out of the prompt (reasoning models' templates drop earlier turns' thinking).
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionIn(msgspec.Struct, kw_only=True):
    name: Any = None  # checked in translate, with the message naming the tool
    description: Any = None
    parameters: Any = None
    strict: bool | None = None  # every call is grammar-exact anyway


class ToolIn(msgspec.Struct, kw_only=True):
    function: FunctionIn
    type: str = "function"


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # A reasoning model's thinking (docs/reasoning.md): its budget in tokens (vLLM's name, and
    # the gateway's own), and whether the answer shows it.
    thinking_token_budget: int | None = None
    max_reasoning_tokens: int | None = None
    include_reasoning: bool = True
    # Extra chat template variables (vLLM's extension), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]

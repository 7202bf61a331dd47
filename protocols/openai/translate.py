"""OpenAI request bodies → internal :class:`~contract.GenerateRequest` s.

Every refusal is an :class:`OpenAIError` (400) naming the offending parameter.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from contract import (
    ChatMessage,
    ChatPrompt,
    ControllerSpec,
    GenerateRequest,
    OutputOptions,
    ReasoningOptions,
    Sampling,
    TextPrompt,
    TokenPrompt,
    ToolCall,
    ToolDefinition,
    reserved_template_kwargs,
)
from protocols.controllers import controller_spec, json_schema_controller
from protocols.jsonbody import BodyError, decode_json
from protocols.openai.errors import OpenAIError
from protocols.openai.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    ToolCallIn,
    ToolIn,
    _Sampling,
)
from protocols.tools import ToolChoice, history_call, tool_definitions, tools_controller

__all__ = [
    "COMPLETION_DEFAULT_MAX_TOKENS",
    "chat_messages",
    "chat_request",
    "chat_tools",
    "completion_requests",
    "decode_body",
    "template_kwargs",
]

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for legacy completions
_MAX_N = 128

T = TypeVar("T")


def decode_body(raw: bytes | dict, schema: type[T]) -> T:
    """Decode and type-check a JSON body (bytes, or a JSON object another protocol already
    decoded); malformed JSON and type errors are 400s."""
    if not isinstance(raw, dict) and not raw.strip():
        raise OpenAIError(400, "request body is empty; expected a JSON object")
    try:
        if isinstance(raw, dict):
            return msgspec.convert(raw, schema)
        return decode_json(raw, schema)
    except msgspec.ValidationError as exc:
        raise OpenAIError(400, f"invalid request: {exc}", _param_of(exc)) from None
    except BodyError as exc:
        raise OpenAIError(400, f"malformed JSON body: {exc}") from None


def _param_of(exc: msgspec.ValidationError) -> str | None:
    # msgspec messages end with "- at `$.field...`"
    text = str(exc)
    if "`$." in text:
        return text.rsplit("`$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
    return None


def _check(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise OpenAIError(400, message, param)


def _controller(body: _Sampling, response_format: dict | None = None) -> ControllerSpec | None:
    """``controller`` / ``controller_arg``, or chat's ``response_format`` (json_schema,
    json_object), which the built-in ``llguidance`` controller enforces."""
    kind = (response_format or {}).get("type", "text")
    try:
        if kind == "text" or response_format is None:
            return controller_spec(body.controller, body.controller_arg)
        _check(body.controller is None, "response_format and controller cannot be combined",
               "response_format")
        if kind == "json_object":
            return json_schema_controller(None)
        _check(kind == "json_schema", f"response_format type {kind!r} is not supported; use "
               "'text', 'json_object' or 'json_schema'", "response_format")
        schema = (response_format or {}).get("json_schema")
        _check(isinstance(schema, dict) and "schema" in schema,
               "response_format json_schema needs json_schema.schema", "response_format")
        assert isinstance(schema, dict)
        return json_schema_controller(schema["schema"])
    except ValueError as exc:
        param = "response_format" if kind != "text" else "controller"
        raise OpenAIError(400, str(exc), param) from None


def _sampling(body: _Sampling, max_tokens: int | None) -> Sampling:
    _check(1 <= body.n <= _MAX_N, f"n must be in [1, {_MAX_N}], got {body.n}", "n")
    _check(max_tokens is None or max_tokens >= 1,
           f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    temperature = 1.0 if body.temperature is None else body.temperature
    _check(0 <= temperature <= 2, f"temperature must be in [0, 2], got {temperature}",
           "temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    _check(0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    _check(top_k >= 0, f"top_k must be -1 (off) or >= 0, got {body.top_k}", "top_k")
    _check(0 <= body.min_p <= 1, f"min_p must be in [0, 1], got {body.min_p}", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        _check(-2 <= value <= 2, f"{name} must be in [-2, 2], got {value}", name)
    _check(body.repetition_penalty > 0,
           f"repetition_penalty must be > 0, got {body.repetition_penalty}", "repetition_penalty")
    _check(body.min_tokens >= 0, "min_tokens must be >= 0", "min_tokens")
    _check(max_tokens is None or body.min_tokens <= max_tokens,
           "min_tokens must not exceed max_tokens", "min_tokens")
    _check(body.best_of is None or body.best_of >= body.n, "best_of must be >= n", "best_of")
    _check(body.stream or body.stream_options is None,
           "stream_options can only be set when stream is true", "stream_options")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return Sampling(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos,
        logit_bias=_logit_bias(body.logit_bias),
        n=body.n,
        best_of=body.best_of,
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    result: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise OpenAIError(400, f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        _check(-100 <= value <= 100, f"logit_bias values must be in [-100, 100], got {value}",
               "logit_bias")
        result[token] = value
    return result


def _output(body: _Sampling, logprobs: int | None, echo: bool = False,
            prompts: int = 1) -> OutputOptions:
    _check(logprobs is None or logprobs >= 0, "logprobs must be >= 0", "logprobs")
    _check(body.prompt_logprobs is None or body.prompt_logprobs >= 0,
           "prompt_logprobs must be >= 0", "prompt_logprobs")
    # A whole response's field (as in vLLM): a stream has no place for it.
    _check(not body.stream or not body.prompt_logprobs,
           "prompt_logprobs are not available when stream is true", "prompt_logprobs")
    # Echo with logprobs lists the prompt's tokens with theirs (OpenAI's legacy completions).
    prompt_logprobs = None if body.stream else body.prompt_logprobs
    if echo and logprobs is not None:
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    return OutputOptions(
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        echo=echo,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        # Streams only grow. Whole responses apply backtracks and show forks as extra choices,
        # except with several prompts, whose choice indices follow each other (no room).
        splices="append" if body.stream else "full" if prompts == 1 else "retract",
    )


def completion_requests(body: CompletionRequest, model: str, request_id: str) -> list[GenerateRequest]:
    """One internal request per prompt (OpenAI allows a batch of prompts)."""
    _check(body.suffix is None, "suffix is not supported", "suffix")
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    sampling = _sampling(body, max_tokens)
    prompts = _prompts(body.prompt, body.add_special_tokens)
    output = _output(body, body.logprobs, body.echo, len(prompts))
    controller = _controller(body)
    return [
        GenerateRequest(
            request_id=f"{request_id}-{i}" if len(prompts) > 1 else request_id,
            model=model,
            prompt=prompt,
            sampling=sampling,
            output=output,
            priority=body.priority,
            controller=controller,
        )
        for i, prompt in enumerate(prompts)
    ]


def _prompts(prompt, add_special_tokens: bool) -> list[TextPrompt | TokenPrompt]:
    if isinstance(prompt, str):
        return [TextPrompt(text=prompt, add_special_tokens=add_special_tokens)]
    _check(len(prompt) > 0, "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [TokenPrompt(token_ids=tuple(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [TextPrompt(text=p, add_special_tokens=add_special_tokens) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [TokenPrompt(token_ids=tuple(p)) for p in prompt]
    raise OpenAIError(
        400, "prompt must be a string, a list of strings, a list of token ids, or a list of "
        "token-id lists", "prompt")


def chat_messages(messages: list[ChatMessageIn],
                  tool_names: frozenset[str] | None = None) -> tuple[ChatMessage, ...]:
    """The conversation; with ``tool_names``, every call in it must name one of those tools,
    and every tool message must answer a call made before it."""
    _check(len(messages) > 0, "messages must not be empty", "messages")
    calls: dict[str, str] = {}  # call id -> function name, as the history made them
    result = []
    for i, message in enumerate(messages):
        tool_calls = tuple(_history_call(f"messages[{i}].tool_calls[{j}]", call, tool_names)
                           for j, call in enumerate(message.tool_calls or ()))
        calls.update((c.id, c.name) for c in tool_calls)
        name = message.name
        if message.role == "tool":
            _check(message.tool_call_id in calls, f"messages[{i}] has role 'tool' but answers "
                   f"tool_call_id {message.tool_call_id!r}, which no earlier assistant message "
                   "called", "messages")
            name = calls[message.tool_call_id]
        result.append(ChatMessage(role=message.role, content=_text_content(message.content),
                                  tool_calls=tool_calls, tool_call_id=message.tool_call_id,
                                  name=name if message.role == "tool" else None))
    return tuple(result)


def _text_content(content: str | list[dict] | None) -> str:
    if not isinstance(content, list):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type")
        _check(kind == "text" and isinstance(part.get("text"), str),
               f"content part of type {kind!r} is not supported by this text-only model",
               "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def _history_call(where: str, call: ToolCallIn, tool_names: frozenset[str] | None) -> ToolCall:
    _check(call.type == "function", f"{where}.type must be 'function'", "messages")
    try:
        return history_call(call.id, call.function.name, call.function.arguments, tool_names,
                            where, f"{where}.function.arguments")
    except ValueError as exc:
        raise OpenAIError(400, str(exc), "messages") from None


def chat_tools(body: ChatCompletionRequest) -> tuple[tuple[ToolDefinition, ...], ToolChoice]:
    """The tools offered and how the model may use them (docs/protocols/tools.md)."""
    try:
        definitions = tool_definitions(body.tools or [], _function, "tools[{}]")
    except ValueError as exc:
        raise OpenAIError(400, str(exc), "tools") from None
    return definitions, _tool_choice(body.tool_choice, bool(definitions))


def _function(tool: ToolIn, where: str) -> tuple[Any, Any, Any]:
    if tool.type != "function":
        raise ValueError(f"{where}.type {tool.type!r} is not supported; use 'function'")
    return tool.function.name, tool.function.description, tool.function.parameters


def _tool_choice(raw: str | dict | None, has_tools: bool) -> ToolChoice:
    if raw is None:
        return ToolChoice(mode="auto" if has_tools else "none")
    if isinstance(raw, dict) and raw.get("type") == "function" \
            and isinstance(raw.get("function"), dict):
        raw, name = "function", raw["function"].get("name")
    elif raw in ("none", "auto", "required"):
        name = None
    else:
        raise OpenAIError(400, "tool_choice is 'none', 'auto', 'required' or {\"type\": "
                               "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    _check(has_tools or raw == "none", "tool_choice needs tools", "tool_choice")
    return ToolChoice(mode=raw, name=name)


def chat_request(body: ChatCompletionRequest, model: str,
                 request_id: str) -> tuple[GenerateRequest, ToolChoice]:
    """The internal request, and how its choices' text is read back (plain, or tool calls)."""
    tools, choice = chat_tools(body)
    _check(body.top_logprobs is None or body.logprobs,
           "top_logprobs requires logprobs to be true", "top_logprobs")
    _check(body.top_logprobs is None or 0 <= body.top_logprobs <= 20,
           "top_logprobs must be in [0, 20]", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request = GenerateRequest(
        request_id=request_id,
        model=model,
        prompt=ChatPrompt(
            messages=chat_messages(body.messages, frozenset(t.name for t in tools) or None),
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=tools if choice.mode != "none" else (),
            template_kwargs=template_kwargs(body.chat_template_kwargs),
        ),
        sampling=_sampling(body, max_tokens),
        output=_output(body, logprobs),
        priority=body.priority,
        controller=_chat_controller(body, tools, choice),
        reasoning=_reasoning(body),
    )
    return request, choice


def template_kwargs(given: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` for the model's chat template, less what the gateway sets."""
    reserved = reserved_template_kwargs(given or {})
    _check(not reserved, f"chat_template_kwargs may not set {', '.join(reserved)}",
           "chat_template_kwargs")
    return dict(given or {})


def _reasoning(body: ChatCompletionRequest) -> ReasoningOptions | None:
    """The reasoning budget (docs/reasoning.md): ``thinking_token_budget`` (vLLM's name) or
    ``max_reasoning_tokens``."""
    budgets = {name: value for name, value in (("thinking_token_budget", body.thinking_token_budget),
                                               ("max_reasoning_tokens", body.max_reasoning_tokens))
               if value is not None}
    if not budgets:
        return None
    _check(len(budgets) == 1, "give thinking_token_budget or max_reasoning_tokens, not both",
           "max_reasoning_tokens")
    [(name, budget)] = budgets.items()
    _check(budget >= 0, f"{name} must be >= 0", name)
    return ReasoningOptions(max_tokens=budget)


def _chat_controller(body: ChatCompletionRequest, tools: tuple[ToolDefinition, ...],
                     choice: ToolChoice) -> ControllerSpec | None:
    if choice.mode == "none":
        return _controller(body, body.response_format)
    _check(body.controller is None, "tools and controller cannot be combined", "controller")
    _check((body.response_format or {}).get("type", "text") == "text",
           "response_format cannot be combined with tools", "response_format")
    try:
        return tools_controller(tools, choice, body.parallel_tool_calls)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), "tool_choice" if choice.mode == "function" else "tools") \
            from None

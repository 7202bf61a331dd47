"""OpenAI request bodies → internal :class:`~protocols.internal.GenerateRequest` s.

Every refusal is an :class:`OpenAIError` (400) naming the offending parameter.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from protocols.controllers import controller_spec, json_schema_controller
from protocols.internal import (
    ChatMessage,
    ChatPrompt,
    ControllerSpec,
    GenerateRequest,
    OutputOptions,
    Sampling,
    TextPrompt,
    TokenPrompt,
)
from protocols.jsonbody import BodyError, decode_json
from protocols.openai.errors import OpenAIError
from protocols.openai.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    _Sampling,
)

__all__ = [
    "COMPLETION_DEFAULT_MAX_TOKENS",
    "chat_messages",
    "chat_request",
    "completion_requests",
    "decode_body",
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
    # Echo with logprobs lists the prompt's tokens with theirs (OpenAI's legacy completions).
    prompt_logprobs = body.prompt_logprobs
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


def chat_messages(messages: list[ChatMessageIn]) -> tuple[ChatMessage, ...]:
    _check(len(messages) > 0, "messages must not be empty", "messages")
    result = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type")
                _check(kind == "text" and isinstance(part.get("text"), str),
                       f"content part of type {kind!r} is not supported by this text-only model",
                       "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        result.append(ChatMessage(role=message.role, content=content or ""))
    return tuple(result)


def chat_request(body: ChatCompletionRequest, model: str, request_id: str) -> GenerateRequest:
    tools_requested = body.tools and body.tool_choice != "none"
    _check(not tools_requested, "tool calling is not supported by this gateway", "tools")
    _check(body.top_logprobs is None or body.logprobs,
           "top_logprobs requires logprobs to be true", "top_logprobs")
    _check(body.top_logprobs is None or 0 <= body.top_logprobs <= 20,
           "top_logprobs must be in [0, 20]", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return GenerateRequest(
        request_id=request_id,
        model=model,
        prompt=ChatPrompt(
            messages=chat_messages(body.messages),
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        ),
        sampling=_sampling(body, max_tokens),
        output=_output(body, logprobs),
        priority=body.priority,
        controller=_controller(body, body.response_format),
    )

"""Engine-neutral admission: one pass that checks a request against the model it is sent to.

Runs once per request, in the engine replica, for every engine kind (``EngineHost``); engines
trust what it admits. Protocol translators check only their own wire format (types, the
protocol's documented ranges); what depends on the model (context length, vocabulary, logprob
counts, what the engine kind can do at all) is checked here, so every protocol refuses the same
requests with the same message, in its own error shape.
"""

from __future__ import annotations

from collections.abc import Iterable

from contract import ChatPrompt, ErrorEvent, GenerateRequest, ModelInfo, Prompt, TokenPrompt
from engines.kit.base import Admitted

__all__ = ["MAX_STOP_TOKEN_IDS", "Refused", "admit", "check_prompt_size", "check_request",
           "prompt_chars"]

# vLLM's GPU model runner holds at most 128 stop ids per request, EOS included, and raises
# inside the engine for more (with min_tokens): refused here for every kind, in shape.
MAX_STOP_TOKEN_IDS = 127


class Refused(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def event(self) -> ErrorEvent:
        return ErrorEvent(kind="validation", message=str(self), param=self.param)


def _check_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    for token in ids:
        if not isinstance(token, int) or not 0 <= token < vocab_size:
            raise Refused(f"token id {token!r} is outside the vocabulary [0, {vocab_size})", param)


def check_request(request: GenerateRequest, info: ModelInfo) -> None:
    """What can be checked before the prompt is tokenized. Raises :class:`Refused`."""
    caps = info.capabilities
    if request.controller is not None and caps.controllers == "none":
        raise Refused(f"controllers are not supported by the {info.engine} engine serving "
                      f"{info.name}", "controller")
    if request.adapter is not None and not caps.adapters:
        raise Refused(f"model {info.name} serves no LoRA adapters (adapter "
                      f"{request.adapter.name!r})", "model")
    check_prompt_size(request.prompt, info)
    if isinstance(request.prompt, TokenPrompt):
        _check_ids(request.prompt.token_ids, info.vocab_size, "prompt")


def check_prompt_size(prompt: Prompt, info: ModelInfo) -> None:
    """Refuse a prompt that cannot fit the context, without tokenizing it: token prompts by
    their length, text and chat by ``info.max_prompt_chars`` (docs/reliability.md). A 20 MB
    prompt took 22 s of the engine replica's event loop to tokenize and then be refused."""
    if isinstance(prompt, TokenPrompt):
        if len(prompt.token_ids) >= info.max_model_len:
            raise _too_long(len(prompt.token_ids), info.max_model_len)
        return
    limit, chars = info.max_prompt_chars, prompt_chars(prompt)
    if limit is not None and chars > limit:
        raise Refused(f"prompt has {chars} characters; this model's maximum context length is "
                      f"{info.max_model_len} tokens, which no prompt of more than {limit} "
                      "characters fits", "prompt")


def prompt_chars(prompt: Prompt) -> int:
    """Characters of text the tokenizer will see (0 for a token prompt); the chat template's
    own text comes on top (it renders roles and contents)."""
    if isinstance(prompt, ChatPrompt):
        calls = (c for m in prompt.messages for c in m.tool_calls)
        return (sum(len(m.role) + len(m.content) for m in prompt.messages)
                + sum(len(c.name) + len(c.arguments) for c in calls)
                + sum(len(t.name) + len(t.description) + len(t.parameters) for t in prompt.tools))
    if isinstance(prompt, TokenPrompt):
        return 0
    return len(prompt.text)


def _too_long(tokens: int, limit: int) -> Refused:
    return Refused(f"prompt has {tokens} tokens; this model's maximum context length is {limit} "
                   "tokens including at least one generated token", "prompt")


def admit(request: GenerateRequest, prompt_ids: list[int], info: ModelInfo) -> Admitted:
    """Check the rendered prompt and the sampling/output options. Raises :class:`Refused`."""
    limit = info.max_model_len
    if not prompt_ids:
        raise Refused("prompt is empty", "prompt")
    if len(prompt_ids) >= limit:
        raise _too_long(len(prompt_ids), limit)
    s, out, caps = request.sampling, request.output, info.capabilities
    room = limit - len(prompt_ids)
    max_tokens = room if s.max_tokens is None else s.max_tokens
    if max_tokens < 1:
        raise Refused("max_tokens must be at least 1", "max_tokens")
    if max_tokens > room:
        raise Refused(f"this model's maximum context length is {limit} tokens; the prompt has "
                      f"{len(prompt_ids)} and {max_tokens} were requested for the completion",
                      "max_tokens")
    if s.n > caps.max_n:
        raise Refused(f"n must be at most {caps.max_n} on the {info.engine} engine", "n")
    if s.best_of is not None and s.best_of > s.n and not caps.best_of_above_n:
        raise Refused(f"best_of > n is not supported by the {info.engine} engine", "best_of")
    for k, limit_k, name in ((out.logprobs, caps.max_logprobs, "logprobs"),
                             (out.prompt_logprobs, caps.max_prompt_logprobs, "prompt_logprobs")):
        if k is None:
            continue
        if limit_k is None:
            raise Refused(f"{name} are not reported by the {info.engine} engine", name)
        if not 0 <= k <= limit_k:
            raise Refused(f"{name} must be in [0, {limit_k}]", name)
    if (s.best_of or 0) > caps.max_n:
        raise Refused(f"best_of must be at most {caps.max_n} on the {info.engine} engine",
                      "best_of")
    # Up to the whole vocabulary (LMQL masks through logit_bias): the ids are distinct keys,
    # each inside the vocabulary, which is the bound.
    _check_ids(s.logit_bias, info.vocab_size, "logit_bias")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise Refused(f"stop_token_ids may have at most {MAX_STOP_TOKEN_IDS} entries",
                      "stop_token_ids")
    _check_ids(s.stop_token_ids, info.vocab_size, "stop_token_ids")
    return Admitted(prompt_ids=prompt_ids, max_tokens=max_tokens)

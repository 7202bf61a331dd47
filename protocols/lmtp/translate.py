"""LMTP GENERATE / SCORE payloads → internal requests. Refusals raise :class:`LMTPError`."""

from __future__ import annotations

from typing import Any

from contract import GenerateRequest, OutputOptions, Sampling, TokenPrompt
from protocols.controllers import controller_spec
from protocols.jsonvalues import is_int, is_number

__all__ = ["LMTPError", "generate_request", "score_request"]

# Decoder arguments an LMTP client may send and the Sampling field each maps to. Anything else
# (e.g. HF's length_penalty, which vLLM can't honour when sampling) is refused, not ignored.
_EXTRA_ARGS = {
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
}
_CONSUMED = {"model", "prompt", "stream_id", "logit_bias", "max_tokens", "temperature",
             "top_logprobs", "scored", "controller", "controller_arg"}
DEFAULT_MAX_TOKENS = 32
DEFAULT_TOP_LOGPROBS = 1


class LMTPError(ValueError):
    """Becomes a ``TOKEN [{"stream_id", "error"}]`` item for the request's stream."""


def _token_ids(payload: dict[str, Any], field: str) -> tuple[int, ...]:
    if field not in payload:
        raise LMTPError(f"missing field '{field}'")
    ids = payload[field]
    if not isinstance(ids, list):
        raise LMTPError(f"'{field}' must be a list of token ids")
    if not all(is_int(t) for t in ids):
        raise LMTPError(f"'{field}' must contain only integer token ids")
    return tuple(ids)


def _logit_bias(raw: Any) -> dict[int, float]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise LMTPError("'logit_bias' must be an object of token id → bias")
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise LMTPError(f"logit_bias key {key!r} is not a token id") from None
        if not is_number(value):
            raise LMTPError(f"logit_bias value for {key!r} must be a number")
        bias[token] = float(value)
    return bias


def generate_request(payload: dict[str, Any], request_id: str) -> GenerateRequest:
    prompt = _token_ids(payload, "prompt")
    if not prompt:
        raise LMTPError("'prompt' must not be empty")
    max_tokens = payload.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not is_int(max_tokens) or max_tokens < 1:
        raise LMTPError(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    temperature = payload.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    if not is_number(temperature) or temperature < 0:
        raise LMTPError(f"'temperature' must be a number >= 0, got {temperature!r}")
    top_logprobs = payload.get("top_logprobs", DEFAULT_TOP_LOGPROBS)
    if not is_int(top_logprobs) or top_logprobs < 0:
        raise LMTPError(f"'top_logprobs' must be a non-negative integer, got {top_logprobs!r}")
    extras: dict[str, Any] = {}
    for key, value in payload.items():
        if key in _CONSUMED:
            continue
        if key not in _EXTRA_ARGS:
            raise LMTPError(f"unsupported decoder argument '{key}'")
        if value is None:
            continue
        if not is_number(value) or (key in ("top_k", "seed") and not is_int(value)):
            raise LMTPError(f"decoder argument '{key}' must be a number, got {value!r}")
        extras[_EXTRA_ARGS[key]] = value
    if extras.get("top_k") == -1:
        extras["top_k"] = 0
    try:
        sampling = Sampling(temperature=float(temperature), max_tokens=max_tokens,
                            logit_bias=_logit_bias(payload.get("logit_bias")), **extras)
    except (TypeError, ValueError) as exc:
        raise LMTPError(f"invalid decoder arguments: {exc}") from None
    try:  # AICI-style controllers (docs/controllers.md): an extension of this gateway
        controller = controller_spec(payload.get("controller"), payload.get("controller_arg"))
    except ValueError as exc:
        raise LMTPError(str(exc)) from None
    return GenerateRequest(
        request_id=request_id,
        model=payload["model"],
        prompt=TokenPrompt(token_ids=prompt),
        sampling=sampling,
        controller=controller,
        # Skip nothing: LMTP is token based, the text is never used.
        output=OutputOptions(logprobs=top_logprobs, skip_special_tokens=False),
    )


def score_request(payload: dict[str, Any], request_id: str) -> tuple[GenerateRequest, int, int]:
    """One request over ``prompt + scored`` that reports prompt logprobs; returns the request
    and the slice (start, count) of prompt positions holding the scored tokens."""
    prompt = _token_ids(payload, "prompt")
    scored = _token_ids(payload, "scored")
    if not scored:
        raise LMTPError("'scored' must not be empty")
    request = GenerateRequest(
        request_id=request_id,
        model=payload["model"],
        prompt=TokenPrompt(token_ids=prompt + scored),
        sampling=Sampling(temperature=0.0, max_tokens=1),
        output=OutputOptions(prompt_logprobs=0, skip_special_tokens=False),
    )
    return request, len(prompt), len(scored)

"""MindIE / Triton ``generate`` bodies → internal requests, validated row by row (seed table).

``parameters`` is validated strictly (MindIE's checker: integers must be JSON integers, booleans
JSON booleans, floats accept integers; out of range → 422 naming the field). Knobs Triton-style
clients put at the top level are read with Triton semantics (``temperature: 0`` = greedy);
``parameters`` wins when both are given. Unknown keys are ignored (tolerant reader).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from contract import GenerateRequest, OutputOptions, Sampling, TextPrompt
from protocols.controllers import controller_spec
from protocols.jsonvalues import is_int, is_number
from protocols.mindie.errors import invalid

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "MindIEOptions", "to_request"]

DEFAULT_MAX_NEW_TOKENS = 20
DEFAULT_PRIORITY = 5
DEFAULT_TIMEOUT_S = 600
MAX_TEXT_CHARS = 4 * 1024 * 1024
_INT32_MAX = 2**31 - 1
_UINT64_MAX = 2**64 - 1
_INT64_MAX = 2**63 - 1
_ID = re.compile(r"[A-Za-z0-9_-]{1,256}")


@dataclass(frozen=True)
class MindIEOptions:
    """What shapes the response, besides the events."""

    id: str
    details: bool


def _int(params: dict, name: str, low: int, high: int, low_open: bool = False):
    value = params.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise invalid(f"Parameter {name} must be an integer, got {value!r}.")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(f"Parameter {name} must be in {bracket}{low},{high}], got {value}.")
    return value


def _float(params: dict, name: str, low: float, high: float | None = None,
           low_open: bool = True):
    value = params.get(name)
    if value is None:
        return None
    if not is_number(value):
        raise invalid(f"Parameter {name} must be a number, got {value!r}.")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        bracket = "(" if low_open else "["
        upper = f"{high}]" if high is not None else "inf)"
        raise invalid(f"Parameter {name} must be in {bracket}{low},{upper}, got {value}.")
    return float(value)


def _bool(params: dict, name: str):
    value = params.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(f"Parameter {name} must be a boolean, got {value!r}.")
    return value


def _words(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise invalid(f"Parameter {name} must be a list of strings.")
    return tuple(w for w in value if w)  # Triton clients send [""] for "none"


def _text_input(body: dict) -> str:
    text = body.get("text_input")
    if text is None:
        raise invalid("The text_input not found.")
    if isinstance(text, list):
        # Triton BYTES tensors arrive as one-element string lists; real parts lists are for
        # multimodal models, which this gateway does not serve.
        if len(text) == 1 and isinstance(text[0], str):
            text = text[0]
        else:
            raise invalid("text_input as a list of parts is only accepted by multimodal "
                          "models; this model is text-only: send a string.")
    if not isinstance(text, str):
        raise invalid("text_input must be a string.")
    if not text:
        raise invalid("text_input must not be empty.")
    if len(text) > MAX_TEXT_CHARS:
        raise invalid(f"text_input must be at most {MAX_TEXT_CHARS} characters.")
    return text


def _request_id(body: dict, fallback: str) -> str:
    if "id" not in body:
        return fallback
    value = body["id"]
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise invalid("Parameter id must be a non-empty string of at most 256 characters "
                      "from [A-Za-z0-9_-].")
    return value


def _merged_knobs(body: dict, params: dict) -> dict[str, Any]:
    """Top-level Triton knobs under ``parameters``' strict ones (parameters win)."""
    knobs: dict[str, Any] = {}
    top_temperature = body.get("temperature")
    for key in ("top_p", "top_k", "max_tokens", "max_new_tokens", "seed", "repetition_penalty",
                "ignore_eos", "min_length", "end_id", "stop_words", "bad_words"):
        if key in body:
            knobs[key] = body[key]
    if is_number(top_temperature):
        if top_temperature == 0:  # TRT-LLM semantics: greedy
            knobs["do_sample"] = False
        else:
            knobs["temperature"] = top_temperature
    knobs.update(params)
    return knobs


def to_request(body: Any, model: str, vocab_size: int, fallback_id: str, *, stream: bool = False
               ) -> tuple[GenerateRequest, MindIEOptions]:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    request_id = _request_id(body, fallback_id)
    text = _text_input(body)
    params = body.get("parameters", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise invalid("Parameter parameters must be an object.")
    knobs = _merged_knobs(body, params)
    details = _bool(knobs, "details") or False
    sampling = _sampling(knobs, vocab_size)
    priority = _int(knobs, "priority", 1, 5)
    timeout = _int(knobs, "timeout", 0, 3600, low_open=True)
    if _words(knobs.get("bad_words"), "bad_words"):
        raise invalid("Parameter bad_words is not supported by this server.")
    try:  # AICI-style controllers (docs/controllers.md): an extension of this gateway
        controller = controller_spec(knobs.get("controller"), knobs.get("controller_arg"))
    except ValueError as exc:
        raise invalid(f"Parameter {exc}.") from None
    request = GenerateRequest(
        request_id=f"mindie-{request_id}-{fallback_id}",
        model=model,
        prompt=TextPrompt(text=text),
        sampling=sampling,
        # generate_stream only grows; generate's one text_output can apply a backtrack but has
        # no place for a fork.
        output=OutputOptions(skip_special_tokens=True, splices="append" if stream else "retract"),
        priority=DEFAULT_PRIORITY if priority is None else priority,
        timeout_s=float(DEFAULT_TIMEOUT_S if timeout is None else timeout),
        controller=controller,
    )
    return request, MindIEOptions(id=request_id, details=details)


def _sampling(knobs: dict, vocab_size: int) -> Sampling:
    """The sampling knobs, checked; MindIE's rule decides greedy or sampling when
    ``do_sample`` is absent."""
    do_sample = _bool(knobs, "do_sample")
    max_new_tokens = _int(knobs, "max_new_tokens", 0, _INT32_MAX, low_open=True)
    if max_new_tokens is None:
        max_new_tokens = _int(knobs, "max_tokens", 0, _INT32_MAX, low_open=True)
    repetition_penalty = _float(knobs, "repetition_penalty", 0.0)
    seed = _int(knobs, "seed", 0, _UINT64_MAX)  # MindIE itself accepts 0
    temperature = _float(knobs, "temperature", 0.0)
    top_k = _int(knobs, "top_k", 0, _INT32_MAX)
    top_p = _float(knobs, "top_p", 0.0, 1.0)
    _int(knobs, "batch_size", 0, _INT32_MAX, low_open=True)  # accepted; no effect here
    _float(knobs, "typical_p", 0.0, 1.0)  # accepted; vLLM has no typical sampling
    _bool(knobs, "watermark")  # accepted; no watermarking here
    _bool(knobs, "perf_stat")  # accepted; timings are always measured
    ignore_eos = _bool(knobs, "ignore_eos") or False
    min_length = _int(knobs, "min_length", 0, _INT32_MAX) or 0
    end_id = knobs.get("end_id")
    if is_int(end_id) and not 0 <= end_id < vocab_size:
        ignore_eos = True  # TRT-LLM's way of asking for exactly max_tokens tokens
    if do_sample is None:  # absent: decided by the other knobs
        do_sample = temperature is not None or top_k is not None or top_p is not None
    if not do_sample:
        temperature = 0.0
    elif temperature is None:
        temperature = 1.0
    if top_k is not None and top_k >= vocab_size:
        top_k = 0
    max_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    return Sampling(
        temperature=temperature,
        top_k=top_k or 0,
        top_p=top_p or 1.0,
        repetition_penalty=repetition_penalty or 1.0,
        seed=None if seed is None else seed % (_INT64_MAX + 1),
        max_tokens=max_tokens,
        min_tokens=min(min_length, max_tokens),
        stop=_words(knobs.get("stop_words"), "stop_words"),
        ignore_eos=ignore_eos,
    )

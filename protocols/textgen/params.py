"""LMI ``GenerationParameters`` and TGI ``GenerateParameters`` → internal sampling and output.

One tolerant reader for both dialects (``docs/protocols/lmi-and-tgi.md``, "Parameters"): ``null``
means unset, ``max_tokens`` / ``stop`` / ``ignore_eos`` are read as aliases, knobs sent at the
top level of the body count when ``parameters`` lacks them, unknown keys are ignored. The
dialects differ in defaults and ranges (:class:`Dialect`). Every problem raises
:class:`InvalidParameters`; routes turn it into their own error shape (LMI 424, TGI 422).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from contract import ControllerSpec, OutputOptions, Sampling
from protocols.controllers import controller_spec, json_schema_controller, regex_controller
from protocols.jsonbody import BodyError, decode_json
from protocols.jsonvalues import is_int, is_number

__all__ = ["LMI", "LMI_TGI_COMPAT", "TGI", "Dialect", "Generation", "InvalidParameters",
           "decode_body", "parse_body", "parse_parameters"]

log = logging.getLogger(__name__)



class InvalidParameters(ValueError):
    """A request the protocol must refuse; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class Dialect:
    """How one dialect reads the shared parameters; every difference a named field."""

    name: str  # for logs
    default_max_new_tokens: int
    default_details: bool
    strict_ranges: bool  # TGI: temperature > 0, top_k > 0, top_p and typical_p in (0, 1)
    max_stop_sequences: int | None
    max_top_n_tokens: int | None  # None: as many as the engine reports (admission checks)
    allows_n: bool  # `n` is read (LMI's vLLM extra); TGI has only best_of
    stream_prefill: bool  # decoder_input_details allowed on streams
    # True (LMI): an explicit do_sample decides and temperature 0 is greedy; False (TGI's
    # NextTokenChooser): do_sample or any sampling knob samples.
    do_sample_decides: bool
    boolean_stop_ignored: bool  # LMI: TensorRT-LLM's boolean `stop` means nothing here
    seed_refused_with_best_of: bool  # TGI refuses a seed with best_of > 1
    max_best_of: int | None = None


_LMI = {"name": "lmi", "default_max_new_tokens": 30, "strict_ranges": False,
        "max_stop_sequences": None, "max_top_n_tokens": None, "allows_n": True,
        "stream_prefill": True, "do_sample_decides": True, "boolean_stop_ignored": True,
        "seed_refused_with_best_of": False}
LMI = Dialect(**_LMI, default_details=False)
LMI_TGI_COMPAT = Dialect(**_LMI, default_details=True)
TGI = Dialect(name="tgi", default_max_new_tokens=100, default_details=False, strict_ranges=True,
              max_stop_sequences=4, max_top_n_tokens=5, allows_n=False, stream_prefill=False,
              do_sample_decides=False, boolean_stop_ignored=False,
              seed_refused_with_best_of=True, max_best_of=2)  # TGI's defaults


_KNOWN = frozenset({
    "do_sample", "seed", "temperature", "repetition_penalty", "top_k", "top_p", "typical_p",
    "max_new_tokens", "max_tokens", "details", "return_full_text", "stop_sequences", "stop",
    "decoder_input_details", "min_p", "presence_penalty", "frequency_penalty", "n", "best_of",
    "num_beams", "length_penalty", "early_stopping", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos_token", "ignore_eos", "logprobs", "prompt_logprobs",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate", "top_n_tokens",
    "watermark", "grammar", "adapter_id", "adapters", "controller", "controller_arg",
})


@dataclass(frozen=True)
class Generation:
    """Engine knobs plus what shapes the response."""

    sampling: Sampling
    output: OutputOptions
    details: bool
    return_full_text: bool
    prefill: bool  # decoder_input_details: report prompt tokens with logprobs
    top_n_tokens: int
    seed: int | None  # reported back (TGI details.seed)
    truncate: int | None  # keep only the last N prompt tokens
    controller: ControllerSpec | None = None
    adapter: str | None = None  # a LoRA adapter of the model (docs/adapters.md)


def decode_body(data: bytes) -> Any:
    try:
        return decode_json(data)
    except BodyError as exc:
        raise InvalidParameters(f"invalid JSON body: {exc}") from None


def parse_body(body: Any, *, allow_list: bool) -> tuple[str | list[str], dict, bool | None]:
    """``{"inputs", "parameters", "stream"}`` → (inputs, merged parameters, stream)."""
    if not isinstance(body, dict):
        raise InvalidParameters("The request body must be a JSON object.")
    inputs = body.get("inputs")
    if isinstance(inputs, list) and allow_list:
        if not inputs or not all(isinstance(x, str) and x for x in inputs):
            raise InvalidParameters("`inputs` must be a non-empty string or a non-empty list of "
                                    "non-empty strings.")
    elif not isinstance(inputs, str):
        raise InvalidParameters("`inputs` is required and must be a string.")
    elif not inputs:
        raise InvalidParameters("`inputs` cannot be empty.")
    params = body.get("parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise InvalidParameters("`parameters` must be a JSON object.")
    top_level = {k: v for k, v in body.items() if k in _KNOWN}
    merged = {**top_level, **{k: v for k, v in params.items() if v is not None}}
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidParameters(f"`stream` must be a boolean, got {stream!r}.")
    return inputs, merged, stream


def _first(p: dict, *names: str) -> tuple[str, Any]:
    for name in names:
        if p.get(name) is not None:
            return name, p[name]
    return names[0], None


def _integer(p: dict, *names: str, low: int | None = None, high: int | None = None):
    name, value = _first(p, *names)
    if value is None:
        return None
    if not is_int(value):
        raise InvalidParameters(f"`{name}` must be an integer, got {value!r}.")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise InvalidParameters(f"`{name}` must be in {bounds}, got {value}.")
    return value


def _number(p: dict, name: str, low: float, high: float | None = None, *,
            low_open: bool = False, high_open: bool = False):
    value = p.get(name)
    if value is None:
        return None
    if not is_number(value):
        raise InvalidParameters(f"`{name}` must be a number, got {value!r}.")
    if value < low or (low_open and value == low) or (
            high is not None and (value > high or (high_open and value == high))):
        upper = "inf)" if high is None else f"{high}{')' if high_open else ']'}"
        raise InvalidParameters(f"`{name}` must be in {'(' if low_open else '['}{low}, {upper}, "
                                f"got {value}.")
    return float(value)


def _flag(p: dict, *names: str) -> bool | None:
    name, value = _first(p, *names)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise InvalidParameters(f"`{name}` must be a boolean, got {value!r}.")
    return value


def _stops(p: dict, dialect: Dialect) -> tuple[str, ...]:
    name, value = _first(p, "stop_sequences", "stop")
    if isinstance(value, bool) and dialect.boolean_stop_ignored:
        value = None  # TensorRT-LLM's boolean `stop`: meaningless for this engine
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise InvalidParameters(f"`{name}` must be a list of non-empty strings, got {value!r}.")
    limit = dialect.max_stop_sequences
    if limit is not None and len(value) > limit:
        raise InvalidParameters(f"`stop` supports up to {limit} stop sequences. "
                                f"Given: {len(value)}")
    return tuple(value)


def _token_ids(p: dict) -> tuple[int, ...]:
    value = p.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value):
        raise InvalidParameters(f"`stop_token_ids` must be a list of token ids, got {value!r}.")
    return tuple(value)


def _refuse_unsupported(p: dict, dialect: Dialect) -> None:
    if _flag(p, "watermark"):
        raise InvalidParameters("`watermark` is not supported by this server.")
    typical_p = _number(p, "typical_p", 0.0, 1.0, low_open=True, high_open=dialect.strict_ranges)
    if typical_p is not None and typical_p != 1.0:
        raise InvalidParameters("`typical_p` is not supported by the vLLM engine; leave it unset.")
    beams = _integer(p, "num_beams", low=1)
    if beams is not None and beams > 1:
        raise InvalidParameters("`num_beams` > 1 (beam search) is not supported by the vLLM v1 "
                                "engine; use `n` or `best_of` with sampling instead.")
    # Only meaningful for beam search, which is refused above: checked, then unused.
    _number(p, "length_penalty", float("-inf"))
    _flag(p, "early_stopping")


def parse_parameters(params: dict, dialect: Dialect, *, stream: bool) -> Generation:
    """Validate ``params`` (already merged by :func:`parse_body`) into a :class:`Generation`."""
    p = params
    unknown = sorted(set(p) - _KNOWN)
    if unknown:
        log.debug("ignoring unknown %s parameters %s", dialect.name, unknown)
    _refuse_unsupported(p, dialect)
    choice = _sampling_choice(p, dialect)
    seed = _integer(p, "seed", low=0, high=2**63 - 1)
    sequences = _sequences(p, dialect, stream=stream, sample=choice.sample, seed=seed)
    top_n = _integer(p, "top_n_tokens", "logprobs", low=0, high=dialect.max_top_n_tokens) or 0
    # prefill reports each prompt token's own logprob; alternatives have no place in the schema
    prompt_logprobs = _integer(p, "prompt_logprobs", low=0, high=1)
    prefill = bool(_flag(p, "decoder_input_details")) or prompt_logprobs is not None
    if prefill and stream and not dialect.stream_prefill:
        raise InvalidParameters("`decoder_input_details` is not supported when streaming tokens.")
    details = _flag(p, "details")
    if details is None and prefill:
        details = True  # as TGI: prefill is reported inside details
    truncate = _integer(p, "truncate", low=1)
    max_new_tokens = _integer(p, "max_new_tokens", "max_tokens", low=1)
    seed = seed if choice.sample else None
    return Generation(
        sampling=_sampling(p, dialect, choice, seed, sequences, max_new_tokens),
        output=_output(p, stream=stream, top_n=top_n, prefill=prefill),
        details=dialect.default_details if details is None else details,
        return_full_text=bool(_flag(p, "return_full_text")), prefill=prefill,
        top_n_tokens=top_n, seed=seed, truncate=truncate, controller=_controller(p),
        adapter=_adapter(p),
    )


def _adapter(p: dict) -> str | None:
    """TGI's ``adapter_id``, LMI's ``adapters`` (one name: a request here has one input)."""
    key, value = _first(p, "adapter_id", "adapters")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidParameters(f"`{key}` must name one LoRA adapter (a non-empty string), "
                                f"got {value!r}.")
    return value


@dataclass(frozen=True)
class _Choice:
    """Greedy or sampling, and the sampling knobs as sent (None: unset)."""

    sample: bool
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None


def _sampling_choice(p: dict, dialect: Dialect) -> _Choice:
    strict = dialect.strict_ranges
    temperature = _number(p, "temperature", 0.0, low_open=strict)
    top_k = _integer(p, "top_k", low=1 if strict else -1)
    top_p = _number(p, "top_p", 0.0, 1.0, low_open=True, high_open=strict)
    min_p = _number(p, "min_p", 0.0, 1.0)
    do_sample = _flag(p, "do_sample")
    warpers = (temperature not in (None, 1.0) or top_k not in (None, 0, -1)
               or top_p not in (None, 1.0) or min_p not in (None, 0.0))
    if dialect.do_sample_decides:
        sample = (do_sample if do_sample is not None else warpers) and temperature != 0.0
    else:
        sample = bool(do_sample) or warpers  # TGI's NextTokenChooser rule
    return _Choice(bool(sample), temperature, top_k, top_p, min_p)


def _sequences(p: dict, dialect: Dialect, *, stream: bool, sample: bool,
               seed: int | None) -> int:
    """How many sequences (``n`` / ``best_of``) the request asks for, checked."""
    n = _integer(p, "n", low=1) if dialect.allows_n else None
    best_of = _integer(p, "best_of", low=1, high=dialect.max_best_of)
    sequences = max(n or 1, best_of or 1)
    if sequences > 1:
        if stream:
            raise InvalidParameters("`n` / `best_of` > 1 is only supported without streaming.")
        if not sample:
            raise InvalidParameters("`n` / `best_of` > 1 needs sampling: set `do_sample` to true.")
        if dialect.seed_refused_with_best_of and seed is not None:
            raise InvalidParameters("`seed` must not be set when `best_of` > 1")  # as TGI
    return sequences


def _sampling(p: dict, dialect: Dialect, choice: _Choice, seed: int | None, sequences: int,
              max_new_tokens: int | None) -> Sampling:
    sample = choice.sample
    return Sampling(
        temperature=(choice.temperature if choice.temperature is not None else 1.0)
        if sample else 0.0,
        top_p=choice.top_p if sample and choice.top_p is not None else 1.0,
        top_k=choice.top_k if sample and choice.top_k is not None and choice.top_k > 0 else 0,
        min_p=choice.min_p if sample and choice.min_p is not None else 0.0,
        repetition_penalty=_number(p, "repetition_penalty", 0.0, low_open=True) or 1.0,
        presence_penalty=_number(p, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=_number(p, "frequency_penalty", -2.0, 2.0) or 0.0,
        seed=seed,
        max_tokens=max_new_tokens or dialect.default_max_new_tokens,
        stop=_stops(p, dialect),
        stop_token_ids=_token_ids(p),
        include_stop_str_in_output=bool(_flag(p, "include_stop_str_in_output")),
        ignore_eos=bool(_flag(p, "ignore_eos_token", "ignore_eos")),
        n=sequences,
    )


def _output(p: dict, *, stream: bool, top_n: int, prefill: bool) -> OutputOptions:
    skip_special = _flag(p, "skip_special_tokens")
    spaces = _flag(p, "spaces_between_special_tokens")
    return OutputOptions(
        logprobs=top_n,  # 0: the sampled token's own logprob, which every Token carries
        prompt_logprobs=0 if prefill else None,  # 0: the prompt token's own logprob
        token_pieces=True,
        # Streams only grow; whole answers apply backtracks and rank forks with the sequences.
        splices="append" if stream else "full",
        skip_special_tokens=True if skip_special is None else skip_special,
        spaces_between_special_tokens=True if spaces is None else spaces,
    )


def _controller(p: dict) -> ControllerSpec | None:
    """TGI's ``grammar`` (``{"type": "json" | "regex", "value": ...}``), run by the built-in
    ``llguidance`` controller, or a named ``controller`` with its ``controller_arg``."""
    grammar = p.get("grammar")
    try:
        if grammar is None:
            return controller_spec(p.get("controller"), p.get("controller_arg"))
        if p.get("controller") is not None:
            raise ValueError("`grammar` and `controller` cannot be combined.")
        if not isinstance(grammar, dict) or "value" not in grammar:
            raise ValueError('`grammar` is {"type": "json" | "regex", "value": ...}.')
        kind, value = grammar.get("type"), grammar["value"]
        if kind in ("json", "json_object", "json_schema"):
            if isinstance(value, str):
                value = msgspec.json.decode(value)
            return json_schema_controller(value or None)
        if kind == "regex":
            return regex_controller(value)
        raise ValueError(f"`grammar` type {kind!r} is not supported; use 'json' or 'regex'.")
    except (ValueError, msgspec.DecodeError) as exc:
        raise InvalidParameters(str(exc)) from None

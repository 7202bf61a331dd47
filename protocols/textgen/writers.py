"""The LMI and TGI writers: one object shape per protocol for the same internal events
(``protocols/textgen/encode.py`` says which fields differ and how the stream is framed)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from contract import FinalEvent, PromptEvent, PromptToken, TokenEvent

__all__ = ["LMIWriter", "ResponseMeta", "SequenceResult", "TGIWriter", "finish_reason",
           "token_text"]

_FINISH = {"eos": "eos_token", "length": "length", "stop_sequence": "stop_sequence"}

def finish_reason(event: FinalEvent) -> str:
    return _FINISH.get(event.finish_reason, "error")


@dataclass(frozen=True)
class ResponseMeta:
    inputs: str  # the prompt as sent
    details: bool
    return_full_text: bool = False
    prefill: bool = False
    top_n_tokens: int = 0
    seed: int | None = None
    eos_token_id: int | None = None  # marks `special` on top alternatives

    @property
    def prefix(self) -> str:
        return self.inputs if self.return_full_text else ""


@dataclass
class SequenceResult:
    """One finished sequence of a non-streamed request."""

    index: int
    tokens: list[TokenEvent] = field(default_factory=list)
    text: str = ""
    final: FinalEvent | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob or 0.0 for t in self.tokens)


def _logprob(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def token_text(event: TokenEvent, extra: str = "") -> str:
    """``extra``: text the engine flushed after this (last) token."""
    text = event.text + extra if event.piece is None else event.piece
    if event.special and not text:
        return event.token_text or ""
    return text


class LMIWriter:
    """The seed's rolling-batch schema."""

    def token(self, event: TokenEvent, text: str) -> dict[str, Any]:
        out: dict[str, Any] = {"id": event.token_id, "text": text,
                               "log_prob": _logprob(event.logprob)}
        if event.special:
            out["special_token"] = True
        return out

    def prompt_token(self, token: PromptToken) -> dict[str, Any]:
        return {"id": token.token_id, "text": token.text, "log_prob": _logprob(token.logprob)}

    def top_tokens(self, event: TokenEvent, meta: ResponseMeta) -> list[dict[str, Any]]:
        return [{"id": t.token_id, "text": t.text, "log_prob": _logprob(t.logprob)}
                for t in event.top_logprobs]

    def step(self, position: int, token: dict, top: list | None) -> dict[str, Any]:
        out: dict[str, Any] = {"token": token}
        if top is not None:
            out["top_tokens"] = top
        return out

    def last(self, step: dict, generated_text: str, details: dict | None) -> dict[str, Any]:
        step["generated_text"] = generated_text
        if details is not None:
            step["details"] = details
        return step

    def stream_details(self, final: FinalEvent, meta: ResponseMeta, prompt: PromptEvent | None):
        details: dict[str, Any] = {"finish_reason": finish_reason(final),
                                   "generated_tokens": final.usage.completion_tokens,
                                   "inputs": meta.inputs}
        if meta.prefill and prompt is not None:
            details["prefill"] = [self.prompt_token(t) for t in prompt.tokens]
        return details

    def details(self, seq: SequenceResult, meta: ResponseMeta, prompt: PromptEvent | None):
        assert seq.final is not None
        details: dict[str, Any] = {"finish_reason": finish_reason(seq.final),
                                   "generated_tokens": seq.final.usage.completion_tokens,
                                   "inputs": meta.inputs,
                                   "tokens": [self.token(t, token_text(t)) for t in seq.tokens]}
        self._extras(details, seq, meta, prompt)
        return details

    def _extras(self, details: dict, seq: SequenceResult, meta: ResponseMeta,
                prompt: PromptEvent | None) -> None:
        if meta.prefill:
            details["prefill"] = [self.prompt_token(t) for t in prompt.tokens] if prompt else []
        if meta.top_n_tokens:
            details["top_tokens"] = [self.top_tokens(t, meta) for t in seq.tokens]

    def best_of(self, seq: SequenceResult, meta: ResponseMeta, prompt: PromptEvent | None):
        assert seq.final is not None
        out: dict[str, Any] = {"generated_text": meta.prefix + seq.text,
                               "finish_reason": finish_reason(seq.final),
                               "generated_tokens": seq.final.usage.completion_tokens,
                               "tokens": [self.token(t, token_text(t)) for t in seq.tokens]}
        self._extras(out, seq, meta, prompt)
        return out

    def stream_error(self, message: str, error_type: str = "generation") -> dict[str, Any]:
        return {"token": {"id": -1, "text": "", "log_prob": -1, "special_token": True,
                          "error_msg": message},
                "generated_text": "",
                "details": {"finish_reason": "error", "generated_tokens": None, "inputs": None}}


class TGIWriter(LMIWriter):
    """TGI's schema. ``with_inputs``: LMI's TGI-compatible mode also reports ``details.inputs``."""

    def __init__(self, with_inputs: bool = False):
        self.with_inputs = with_inputs

    def token(self, event: TokenEvent, text: str) -> dict[str, Any]:
        return {"id": event.token_id, "text": text, "logprob": _logprob(event.logprob),
                "special": event.special}

    def prompt_token(self, token: PromptToken) -> dict[str, Any]:
        return {"id": token.token_id, "text": token.text, "logprob": _logprob(token.logprob)}

    def top_tokens(self, event: TokenEvent, meta: ResponseMeta) -> list[dict[str, Any]]:
        return [{"id": t.token_id, "text": t.text, "logprob": _logprob(t.logprob),
                 "special": t.token_id == meta.eos_token_id} for t in event.top_logprobs]

    def step(self, position: int, token: dict, top: list | None) -> dict[str, Any]:
        out: dict[str, Any] = {"index": position, "token": token}
        if top is not None:
            out["top_tokens"] = top
        out.update(generated_text=None, details=None)
        return out

    def last(self, step: dict, generated_text: str, details: dict | None) -> dict[str, Any]:
        step.update(generated_text=generated_text, details=details)
        return step

    def stream_details(self, final: FinalEvent, meta: ResponseMeta, prompt: PromptEvent | None):
        details: dict[str, Any] = {"finish_reason": finish_reason(final),
                                   "generated_tokens": final.usage.completion_tokens,
                                   "seed": meta.seed, "input_length": final.usage.prompt_tokens}
        if self.with_inputs:
            details["inputs"] = meta.inputs
        return details

    def details(self, seq: SequenceResult, meta: ResponseMeta, prompt: PromptEvent | None):
        details = self._sequence(seq, meta, prompt)
        if self.with_inputs:
            details["inputs"] = meta.inputs
        return details

    def _sequence(self, seq: SequenceResult, meta: ResponseMeta, prompt: PromptEvent | None):
        assert seq.final is not None
        out: dict[str, Any] = {
            "finish_reason": finish_reason(seq.final),
            "generated_tokens": seq.final.usage.completion_tokens,
            "seed": meta.seed,
            # TGI always sends the list; it is empty unless decoder_input_details was asked for.
            "prefill": [self.prompt_token(t) for t in prompt.tokens] if prompt else [],
            "tokens": [self.token(t, token_text(t)) for t in seq.tokens],
        }
        if meta.top_n_tokens:
            out["top_tokens"] = [self.top_tokens(t, meta) for t in seq.tokens]
        return out

    def best_of(self, seq: SequenceResult, meta: ResponseMeta, prompt: PromptEvent | None):
        return {"generated_text": meta.prefix + seq.text, **self._sequence(seq, meta, prompt)}

    def stream_error(self, message: str, error_type: str = "generation") -> dict[str, Any]:
        return {"error": message, "error_type": error_type}



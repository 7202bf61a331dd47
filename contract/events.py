"""The events an engine yields for one :class:`~contract.requests.GenerateRequest`, and the
stream contract they follow (every engine kind, every protocol: docs/engines.md).

Stream contract (what every engine yields for one request):

1. at most one :class:`PromptEvent` first, when prompt token ids or prompt logprobs were asked
   for (``OutputOptions.prompt_logprobs`` / ``echo``);
2. per choice ``index``, in order: :class:`TokenEvent` s, one per token appended to the choice
   (``forced`` when a controller appended it without sampling: fast-forward), and, only as far
   as the request's ``OutputOptions.splices`` allows, :class:`BacktrackEvent` s (the choice's
   last tokens are withdrawn; ``"retract"`` and ``"full"``) and :class:`ForkEvent` s (a new
   choice starts as a copy of this one, before any event of the new index; ``"full"``). A splice
   the request does not allow ends the stream with the :class:`ErrorEvent` of
   :func:`splice_refusal` instead (the engine host enforces this for every engine kind);
3. exactly one :class:`FinalEvent` per choice; the stream ends after the last choice's. A
   :class:`TokenEvent` with ``last`` set is its choice's last event before the FinalEvent;
4. or, instead of (2)/(3) or after some of them, one :class:`ErrorEvent`, which ends the stream.

Refusals are events, never exceptions: a request the engine cannot serve yields one
:class:`ErrorEvent` first, so every protocol can answer with its own status and shape.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from contract.base import Frozen as _Frozen
from contract.requests import SpliceSupport

__all__ = ["BacktrackEvent", "DEADLOCK", "ErrorEvent", "ErrorKind", "Event", "FinalEvent",
           "FinishReason", "ForkEvent", "PromptEvent", "PromptToken", "Timings", "TokenEvent",
           "TopLogprob", "Usage", "as_error", "decode_events", "encode_events", "splice_allowed",
           "splice_refusal"]


# --- events -------------------------------------------------------------------------------

FinishReason = Literal["eos", "stop_sequence", "length", "abort", "error"]
# overloaded: the service is full, retry later; rate_limited: the caller's own limit (its key's
# token budget); unavailable: no healthy engine replica now; engine: the engine failed it.
ErrorKind = Literal["validation", "not_found", "overloaded", "rate_limited", "unavailable", "engine"]


class TopLogprob(_Frozen, kw_only=True):
    token_id: int
    text: str
    logprob: float


class PromptToken(_Frozen, kw_only=True):
    token_id: int
    text: str
    logprob: float | None = None  # None for the first position (no context)
    top_logprobs: tuple[TopLogprob, ...] = ()
    # This token's rank among the model's candidates at its position (1 = the most likely);
    # None where ``logprob`` is, or where an engine does not rank.
    rank: int | None = None


class PromptEvent(_Frozen, tag="prompt", kw_only=True):
    """The prompt as the engine saw it: ids, text and (if asked) per-position logprobs."""

    text: str
    tokens: tuple[PromptToken, ...]


class TokenEvent(_Frozen, tag="token", kw_only=True):
    """One generated token. ``text`` is the text delta it completes (may be empty while the
    detokenizer holds back an incomplete character or a possible stop string)."""

    index: int = 0
    token_id: int
    text: str
    # A reasoning model's thinking (docs/reasoning.md): the part of this token's text delta
    # that is reasoning. ``text`` is then the answer's part only, so a protocol that shows no
    # reasoning renders ``text`` alone; the markers around the reasoning are in neither.
    reasoning: str = ""
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()
    special: bool = False
    token_text: str | None = None  # this token's own text, when logprobs were requested
    # With ``OutputOptions.token_pieces``: the text this token adds by plain incremental
    # detokenization ("" while a character is incomplete). ``text`` can't serve there: it lags
    # behind the tokens while a stop string may be forming, and when vLLM merges the deltas of
    # several steps (a busy consumer) the whole text lands on the last token.
    piece: str | None = None
    last: bool = False  # the choice's FinalEvent follows immediately (no more tokens come)
    forced: bool = False  # appended by a controller without sampling (fast-forward); no logprob
    # Engine-side measurements, for protocols that report per-token timing (MindIE):
    elapsed_s: float = 0.0  # since the engine received the request, when this token was produced
    batch_size: int = 0  # requests in flight in this engine replica at that moment
    queue_s: float | None = None  # on a choice's first token: admitted → first scheduled
    # A controlled choice: what its controller logged, the variables it wrote and the
    # microseconds it ran since the previous event that carried them (AICI streams them with
    # each event); the rest comes with the FinalEvent.
    logs: str = ""
    storage: tuple[dict[str, Any], ...] = ()
    micros: int = 0


class BacktrackEvent(_Frozen, tag="backtrack", kw_only=True):
    """The last ``count`` tokens of choice ``index`` are withdrawn; ``text`` is the text their
    TokenEvents had added, so consumers that keep text can cut exactly that much."""

    index: int = 0
    count: int
    text: str = ""


class ForkEvent(_Frozen, tag="fork", kw_only=True):
    """Choice ``index`` is new and starts as a copy of choice ``parent`` as it stands now (its
    tokens and text); events of either choice follow independently."""

    index: int
    parent: int = 0


class Usage(_Frozen, kw_only=True):
    """Per choice. ``completion_tokens``: tokens in the choice's output as finally returned
    (after backtracks; a fork counts what it inherited). ``forced_tokens``: tokens appended to
    it without sampling; ``sampled_tokens``: tokens its sampler drew, retracted ones included
    (``None``: no splices happened, so ``completion_tokens - forced_tokens``)."""

    prompt_tokens: int
    completion_tokens: int
    forced_tokens: int = 0
    sampled_tokens: int | None = None
    # Prompt tokens the engine took from its prefix cache (a controlled run: summed over the
    # resubmissions its edits cost).
    cached_tokens: int = 0
    # Of ``completion_tokens``, those of a reasoning model's thinking, its end marker included.
    reasoning_tokens: int = 0

    @property
    def sampled(self) -> int:
        if self.sampled_tokens is not None:
            return self.sampled_tokens
        return self.completion_tokens - self.forced_tokens


class Timings(_Frozen, kw_only=True):
    """Seconds. ``queue_s``: admitted → scheduled; ``ttft_s``: arrival → first token;
    ``decode_s``: first → last token."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0


class FinalEvent(_Frozen, tag="final", kw_only=True):
    index: int = 0
    finish_reason: FinishReason
    stop_reason: str | int | None = None  # matched stop string or stop token id
    usage: Usage
    timings: Timings = Timings()
    text: str = ""  # trailing text flushed at the end (held-back bytes); usually empty
    reasoning: str = ""  # the reasoning part of that trailing text (TokenEvent.reasoning)
    # What the choice's controller logged, the variables it wrote (AICI's ``storage``
    # entries, ``{"WriteVar": {"name", "value": <hex>, "op", "when_version_is"}}``) and the
    # microseconds it ran, since its last TokenEvent that carried them.
    logs: str = ""
    storage: tuple[dict[str, Any], ...] = ()
    micros: int = 0


class ErrorEvent(_Frozen, tag="error", kw_only=True):
    kind: ErrorKind
    message: str
    param: str | None = None


# ErrorEvent.param of a controlled run whose branches are all suspended (AICI's "deadlock")
DEADLOCK = "deadlock"


Event = PromptEvent | TokenEvent | BacktrackEvent | ForkEvent | FinalEvent | ErrorEvent


def splice_allowed(event: BacktrackEvent | ForkEvent, support: SpliceSupport) -> bool:
    if isinstance(event, BacktrackEvent):
        return support != "append"
    return support == "full"


def as_error(event: ErrorEvent | BacktrackEvent | ForkEvent) -> ErrorEvent:
    """What ends a stream that can only grow: an error, or a splice it cannot show."""
    return event if isinstance(event, ErrorEvent) else splice_refusal(event)


def splice_refusal(event: BacktrackEvent | ForkEvent) -> ErrorEvent:
    """The error that ends a stream whose consumer cannot render ``event``."""
    what = "withdrew tokens" if isinstance(event, BacktrackEvent) else "forked into a new choice"
    return ErrorEvent(kind="validation", param="controller", message=f"the controller {what}, "
                      "which this response cannot show; send the request without streaming")


# --- wire codec between processes (engine replica ↔ ingress) -------------------------------

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Event])


def encode_events(events: list[Event]) -> bytes:
    """Pack a batch of events for crossing a process boundary (much cheaper than pickle)."""
    return _encoder.encode(events)


def decode_events(data: bytes) -> list[Event]:
    return _decoder.decode(data)

"""vLLM ``RequestOutput`` deltas → internal events (one :class:`TokenEvent` per token)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from contract import (
    Event,
    FinalEvent,
    FinishReason,
    GenerateRequest,
    PromptEvent,
    PromptToken,
    Timings,
    TokenEvent,
    TopLogprob,
    Usage,
)
from engines.kit.detokenize import IncrementalDecoder

__all__ = ["Translator", "finish_reason"]


class Translator:
    """Turns one request's ``RequestOutput`` deltas into internal events."""

    def __init__(self, request: GenerateRequest, prompt_ids: list[int], special_ids: frozenset[int],
                 tokenizer: Any, batch_size: Callable[[], int]):
        self.request = request
        self.batch_size = batch_size
        self.prompt_ids = prompt_ids
        self.special_ids = special_ids
        self.tokenizer = tokenizer
        self.want_prompt = request.output.echo or request.output.prompt_logprobs is not None
        self.counts: dict[int, int] = {}
        # Per choice, its incremental detokenizer (TokenEvent.piece), when the protocol asked
        # for per-token text.
        self.pieces: dict[int, IncrementalDecoder] | None = (
            {} if request.output.token_pieces else None)
        self.open: set[int] = set(range(request.sampling.n))
        self.started = time.monotonic()

    def feed(self, output) -> list[Event]:
        events: list[Event] = []
        if self.want_prompt:
            self.want_prompt = False
            events.append(self._prompt_event(output))
        # Requests in flight when these tokens were produced: vLLM no longer counts this one
        # once its last output is out, though it was in the batch that produced it.
        batch_size = self.batch_size() + (1 if output.finished else 0)
        for choice in output.outputs:
            events.extend(self._tokens(choice, output.metrics, batch_size))
            if choice.finish_reason is not None and choice.index in self.open:
                events.append(self._final(choice.index, choice.finish_reason, choice.stop_reason,
                                          output.metrics,
                                          getattr(output, "num_cached_tokens", 0) or 0))
        return events

    def _prompt_event(self, output) -> PromptEvent:
        ids = output.prompt_token_ids or self.prompt_ids
        logprobs = output.prompt_logprobs or [None] * len(ids)
        tokens = []
        for token_id, entry in zip(ids, logprobs, strict=False):
            chosen = entry.get(token_id) if entry else None
            tokens.append(
                PromptToken(
                    token_id=token_id,
                    text=chosen.decoded_token if chosen and chosen.decoded_token is not None
                    else self.tokenizer.decode([token_id]),
                    logprob=chosen.logprob if chosen else None,
                    top_logprobs=_top(entry, self.request.output.prompt_logprobs),
                    rank=chosen.rank if chosen else None,
                )
            )
        text = output.prompt if output.prompt is not None else self.tokenizer.decode(ids)
        return PromptEvent(text=text, tokens=tuple(tokens))

    def _tokens(self, choice, metrics, batch_size: int) -> list[TokenEvent]:
        ids = choice.token_ids
        if not ids:
            return []
        first = choice.index not in self.counts
        self.counts[choice.index] = self.counts.get(choice.index, 0) + len(ids)
        elapsed = time.monotonic() - self.started
        queue = _queue_wait(metrics) if first else None
        k = self.request.output.logprobs
        events = []
        last = len(ids) - 1
        finishing = choice.finish_reason is not None
        for i, token_id in enumerate(ids):
            entry = choice.logprobs[i] if choice.logprobs else None
            chosen = entry.get(token_id) if entry else None
            events.append(
                TokenEvent(
                    index=choice.index,
                    token_id=token_id,
                    # vLLM detokenizes per delta, not per token: the delta's text belongs to the
                    # token that completed it, the last one.
                    text=choice.text if i == last else "",
                    logprob=chosen.logprob if chosen else None,
                    top_logprobs=_top(entry, k),
                    special=token_id in self.special_ids,
                    token_text=chosen.decoded_token if chosen else None,
                    piece=self._piece(choice.index, token_id) if self.pieces is not None
                    else None,
                    last=finishing and i == last,
                    elapsed_s=elapsed,
                    batch_size=batch_size,
                    queue_s=queue if i == 0 else None,
                )
            )
        return events

    def _piece(self, index: int, token_id: int) -> str:
        """The text ``token_id`` adds to choice ``index`` (``engines.kit.detokenize``; the window
        starts in the prompt's tail)."""
        assert self.pieces is not None
        decoder = self.pieces.get(index)
        if decoder is None:
            decoder = self.pieces[index] = IncrementalDecoder(
                self.tokenizer, self.prompt_ids[-5:], self.request.output.skip_special_tokens)
        return decoder.add(token_id)

    def _final(self, index, reason, stop_reason, metrics, cached: int = 0) -> FinalEvent:
        self.open.discard(index)
        return FinalEvent(
            index=index,
            finish_reason=finish_reason(reason, stop_reason, self.request.sampling.stop_token_ids),
            stop_reason=stop_reason,
            usage=Usage(prompt_tokens=len(self.prompt_ids),
                        completion_tokens=self.counts.get(index, 0), cached_tokens=cached),
            timings=self._timings(metrics),
        )

    def _timings(self, metrics) -> Timings:
        if metrics is None or not getattr(metrics, "first_token_ts", 0):
            return Timings(ttft_s=time.monotonic() - self.started)
        return Timings(
            queue_s=_queue_wait(metrics),
            ttft_s=metrics.first_token_latency,
            decode_s=max(0.0, metrics.last_token_ts - metrics.first_token_ts),
        )


def _queue_wait(metrics) -> float:
    """Seconds from admission to first scheduling (0 when vLLM reported no stats)."""
    if metrics is None:
        return 0.0
    return max(0.0, metrics.scheduled_ts - metrics.queued_ts)


def _top(entry: dict[int, Any] | None, k: int | None) -> tuple[TopLogprob, ...]:
    if not entry or not k:
        return ()
    ranked = sorted(
        (lp.rank, token_id, lp) for token_id, lp in entry.items() if lp.rank is not None
    )
    return tuple(
        TopLogprob(token_id=token_id, text=lp.decoded_token or "", logprob=lp.logprob)
        for rank, token_id, lp in ranked
        if rank <= k
    )


def finish_reason(reason: str, stop_reason: str | int | None,
                   requested_stop_ids: tuple[int, ...]) -> FinishReason:
    if reason == "stop":
        # vLLM adds the generation config's extra EOS ids (Llama 3's <|eot_id|>, ...) to the
        # stop token ids; stopping on one of those is an EOS, not a client's stop sequence.
        if stop_reason is None or (isinstance(stop_reason, int)
                                   and stop_reason not in requested_stop_ids):
            return "eos"
        return "stop_sequence"
    if reason in ("length", "abort", "error"):
        return reason  # type: ignore[return-value]
    return "error"

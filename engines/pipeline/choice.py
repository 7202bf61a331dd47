"""One choice of a request on the pipeline kind: its sequence, sampler and output text, and the
step the origin's scheduler calls after each forward that completes its tokens (on the origin
thread): sample, see whether the choice ends, and say which events that makes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from contract import (
    Event,
    FinalEvent,
    FinishReason,
    GenerateRequest,
    Timings,
    TokenEvent,
    TopLogprob,
    Usage,
)
from engines.kit.base import Admitted
from engines.pipeline.jobs import Sequence
from engines.pipeline.sampling import Sampler
from engines.pipeline.text import OutputText

if TYPE_CHECKING:
    from engines.pipeline.engine import PipelineEngine

__all__ = ["Choice"]


class Choice:
    """Choice ``index`` of ``request``; ``queue_s``: how long it waited for a slot."""

    def __init__(self, engine: PipelineEngine, request: GenerateRequest, admitted: Admitted,
                 index: int, started: float, queue_s: float,
                 control: Callable[[list[int]], Any] | None = None):
        self.engine, self.request, self.index = engine, request, index
        self.started, self.queue_s = started, queue_s
        self.prompt_ids = admitted.prompt_ids
        self.max_tokens = admitted.max_tokens
        s, out = request.sampling, request.output
        self.seq = Sequence(seq_id=f"{request.request_id}/{index}", tokens=list(self.prompt_ids))
        self.sampler = Sampler(s, self.prompt_ids, engine.eos_ids, engine.model_info().vocab_size,
                               seed_offset=index)
        self.text = OutputText(engine.tokenizer, self.prompt_ids, out.skip_special_tokens, s.stop,
                               s.include_stop_str_in_output)
        self.generated = 0
        self.first_token_at: float | None = None
        # A controlled segment's hook: the sequence's tokens → its mask for this step
        # (engines/pipeline/controlled.py).
        self.control = control

    def step(self, logits: Any, prompt_hidden: list[Any] | None) -> tuple[list[Event], bool]:
        """The events of the next token (the prompt's first, when asked for) and whether the
        choice ends with it; appends the token to the sequence."""
        out, tokenizer = self.request.output, self.engine.tokenizer
        events: list[Event] = []
        if prompt_hidden is not None:
            events.append(self.engine.prompt_event(self.prompt_ids, prompt_hidden,
                                                   out.prompt_logprobs))
        self.generated += 1
        mask = self.control(self.seq.tokens) if self.control is not None else None
        token, logprobs = self.sampler.sample(logits, out.logprobs, mask)
        self.seq.tokens.append(token)
        reason, stop_reason, delta, piece = self._advance(token)
        now = time.monotonic()
        self.first_token_at = self.first_token_at or now
        events.append(TokenEvent(
            index=self.index, token_id=token, text=delta,
            logprob=logprobs.token_logprob if logprobs else None,
            top_logprobs=self._top(logprobs), special=token in self.engine.special_ids,
            token_text=tokenizer.decode([token]) if logprobs else None,
            piece=piece if out.token_pieces else None, last=reason is not None,
            elapsed_s=now - self.started, batch_size=self.engine.live,
            queue_s=self.queue_s if self.generated == 1 else None))
        if reason is not None:
            events.append(FinalEvent(
                index=self.index, finish_reason=reason, stop_reason=stop_reason,
                usage=Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=self.generated),
                timings=Timings(queue_s=self.queue_s, ttft_s=self.first_token_at - self.started,
                                decode_s=now - self.first_token_at),
                text=self.text.flush() if stop_reason is None or isinstance(stop_reason, int)
                else ""))
        return events, reason is not None

    def _advance(self, token: int) -> tuple[FinishReason | None, str | int | None, str, str]:
        """Why the choice ends after ``token`` (or None), the stop reason, the text delta to
        send and the token's own piece of text."""
        s, text = self.request.sampling, self.text
        stop_id = token in s.stop_token_ids
        if stop_id or (token in self.engine.eos_ids and not s.ignore_eos):
            # A stop token's text is output only with include_stop_str_in_output (vLLM); the
            # model's extra EOS ids (generation config) count as EOS.
            if s.include_stop_str_in_output:
                piece, delta, _ = text.add(token, check_stops=False)
            else:
                piece, delta = text.piece(token), ""
            if stop_id:
                return "stop_sequence", token, delta, piece
            eos = self.engine.tokenizer.eos_token_id
            return "eos", None if token == eos else token, delta, piece
        piece, delta, stop = text.add(token, check_stops=self.generated >= s.min_tokens)
        if stop is not None:
            return "stop_sequence", stop, delta, piece
        if (self.generated >= self.max_tokens
                or len(self.seq.tokens) >= self.engine.model_info().max_model_len):
            return "length", None, delta, piece
        return None, None, delta, piece

    def _top(self, logprobs) -> tuple[TopLogprob, ...]:
        if not logprobs:
            return ()
        decode = self.engine.tokenizer.decode
        return tuple(TopLogprob(token_id=t, text=decode([t]), logprob=lp) for t, lp in logprobs.top)

"""One branch of a controlled run as the events it emits (``engines/controllers/driver/run.py``).

The output so far (ids and the text each added), the token held back until the next says
whether it is the last (encoders put the finish on that token), the controller's logs, storage
and time not yet carried by an event, and the counts its usage reports.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import msgspec

from contract import (
    BacktrackEvent,
    Event,
    FinalEvent,
    FinishReason,
    GenerateRequest,
    Timings,
    TokenEvent,
    Usage,
)
from engines.kit.detokenize import IncrementalDecoder

__all__ = ["BranchOutput"]


class BranchOutput:
    def __init__(self, request: GenerateRequest, tokenizer: Any, prompt_tokens: int) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.index = 0  # the choice this branch is (0: the request's own sequence)
        self.out: list[int] = []
        self.texts: list[str] = []  # the text each output token's event added
        self.forced = 0
        self.sampled = 0  # withdrawn ones included
        self.spliced = False
        # What the controller logged, stored and spent that no event has carried yet: the
        # next token this branch emits carries it (AICI streams them with each event).
        self.logs: list[str] = []
        self.storage: list[dict] = []
        self.micros = 0
        self.cached = 0  # prompt tokens from the prefix cache, over all segments
        self.carry = ""  # text of a dropped stop token's delta, for the next event
        self.pending: TokenEvent | None = None  # emitted once the next one is known
        self.started = time.monotonic()
        self.first_token: float | None = None

    def fork(self, index: int) -> BranchOutput:
        """A copy for branch ``index``: the output so far and its counts; none of the notes,
        nor the cache hits, which this branch's events and usage report. Flush first."""
        assert self.pending is None
        child = copy.copy(self)
        child.index = index
        child.out, child.texts = list(self.out), list(self.texts)
        child.logs, child.storage, child.micros, child.cached = [], [], 0, 0
        return child

    def note(self, logs: str, storage: list[dict], micros: int) -> None:
        """What the controller reported with an ``advance``: carried by the next event."""
        if logs:
            self.logs.append(logs)
        self.storage += storage
        self.micros += micros

    def hold(self, event: TokenEvent) -> list[TokenEvent]:
        """Append ``event``'s token to the output and keep it back until the next one (or the
        end) says whether it is the run's last; the one held before goes out."""
        self.out.append(event.token_id)
        self.sampled += not event.forced
        if self.first_token is None:
            self.first_token = time.monotonic()
        if self.carry:
            event = msgspec.structs.replace(event, text=self.carry + event.text)
            self.carry = ""
        if event.index != self.index:
            event = msgspec.structs.replace(event, index=self.index)
        self.texts.append(event.text)
        out = self.flush()
        self.pending = event
        return out

    def flush(self, last: bool = False) -> list[TokenEvent]:
        held, self.pending = self.pending, None
        if held is None:
            return []
        if self.logs or self.storage or self.micros:
            held = msgspec.structs.replace(held, last=last, **self._notes())
        elif held.last != last:
            held = msgspec.structs.replace(held, last=last)
        return [held]

    def _notes(self) -> dict:
        """The logs, storage and micros no event carried yet, taken for one."""
        notes = {"logs": "".join(self.logs), "storage": tuple(self.storage),
                 "micros": self.micros}
        self.logs, self.storage, self.micros = [], [], 0
        return notes

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> list[Event]:
        return [*self.flush(last=True), self._final(reason, stop_reason)]

    def backtrack(self, count: int) -> list[Event]:
        """Withdraw the output's last ``count`` tokens (at most all of them; the held one goes
        out first: consumers see every token they are told to withdraw)."""
        assert count <= len(self.out)
        events: list[Event] = [*self.flush()]
        text = "".join(self.texts[-count:])
        del self.out[-count:], self.texts[-count:]
        self.carry = ""  # text held back from the withdrawn tokens
        self.spliced = True
        events.append(BacktrackEvent(index=self.index, count=count, text=text))
        return events

    def forced_events(self, tokens: list[int]) -> list[TokenEvent]:
        """Their text by incremental detokenization from the output's tail (as vLLM's and
        TGI's detokenizers: an incomplete character waits for the token that completes it)."""
        events = []
        decoder = IncrementalDecoder(self.tokenizer, self.out[-6:],
                                     self.request.output.skip_special_tokens)
        for token in tokens:
            text = decoder.add(token)
            own = self.text([token]) if self.request.output.logprobs is not None else None
            self.forced += 1
            events.append(TokenEvent(index=self.index, token_id=token, text=text, forced=True,
                                     token_text=own,
                                     piece=text if self.request.output.token_pieces else None,
                                     elapsed_s=time.monotonic() - self.started))
        return events

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.request.output
                                     .skip_special_tokens)

    def _final(self, reason: FinishReason, stop_reason: str | int | None = None) -> FinalEvent:
        now = time.monotonic()
        first = self.first_token or now
        return FinalEvent(index=self.index, finish_reason=reason, stop_reason=stop_reason,
                          text=self.carry, **self._notes(),
                          usage=Usage(prompt_tokens=self.prompt_tokens,
                                      completion_tokens=len(self.out),
                                      forced_tokens=self.forced,
                                      sampled_tokens=self.sampled if self.spliced else None,
                                      cached_tokens=self.cached),
                          timings=Timings(ttft_s=first - self.started, decode_s=now - first))

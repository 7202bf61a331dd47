"""A reasoning model's thinking, kept apart from its answer in every engine kind's events
(docs/reasoning.md).

:class:`ReasoningFormat` is one model's format: vLLM's reasoning parser of that name over the
model's tokenizer (the same parser vLLM's own server uses; nothing here re-implements one), and
the end-of-reasoning marker as token ids. The engine host puts every stream of the model through
:meth:`ReasoningFormat.split`, which moves each token's thinking from ``TokenEvent.text`` to
``TokenEvent.reasoning`` and counts the thinking's tokens into ``Usage.reasoning_tokens``; and it
runs a request that bounds its reasoning or brings its own controller under the ``reasoning``
controller (:meth:`ReasoningFormat.steer`, ``engines/controllers/runtime/reasoning.py``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

import msgspec

from contract import (
    BacktrackEvent,
    ControllerSpec,
    Event,
    FinalEvent,
    ForkEvent,
    GenerateRequest,
    TokenEvent,
)

__all__ = ["ReasoningFormat", "reasoning_parsers"]


def reasoning_parsers() -> list[str]:
    """The names vLLM's reasoning parsers are registered under."""
    from vllm.reasoning import ReasoningParserManager

    return sorted(ReasoningParserManager.list_registered())


class ReasoningFormat:
    """``parser``: a vLLM reasoning parser's name; ``tokenizer``: the model's (what the parser
    reads its markers' ids from); ``budget_end``: the text forced when a reasoning budget is
    spent (None: the parser's end marker)."""

    def __init__(self, parser: str, tokenizer: Any, budget_end: str | None = None) -> None:
        from vllm.reasoning import ReasoningParserManager

        self.name = parser
        self.parser = ReasoningParserManager.get_reasoning_parser(parser)(tokenizer)
        end = budget_end or self.parser.reasoning_end_str
        if not end:
            raise ValueError(f"reasoning parser {parser!r} names no end marker; set budget_end")
        self.end_ids = list(tokenizer.encode(end, add_special_tokens=False))

    def thinks_after(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the output after this prompt starts in reasoning (a prompt that closed the
        reasoning itself, as a template does when thinking is turned off, starts in the
        answer)."""
        return not self.parser.is_reasoning_end(list(prompt_ids))

    def steer(self, request: GenerateRequest) -> GenerateRequest:
        """``request`` under the ``reasoning`` controller, when it bounds its reasoning or has
        a controller that must start after the reasoning; else as it is."""
        budget = request.reasoning.max_tokens if request.reasoning is not None else None
        if budget is None and request.controller is None:
            return request
        inner = request.controller
        arg = {"end": self.end_ids, "budget": budget,
               "inner": None if inner is None else {"module": inner.module, "arg": inner.arg}}
        return msgspec.structs.replace(
            request, controller=ControllerSpec(module="reasoning", arg=json.dumps(arg)))

    async def split(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """``events`` of an output that starts in reasoning (:meth:`thinks_after`), with each
        choice's thinking moved to ``reasoning``."""
        choices: dict[int, _Choice] = {}
        async with aclosing(events):  # closing this stream closes (aborts) the engine's
            async for event in events:
                if isinstance(event, (TokenEvent, FinalEvent, BacktrackEvent)):
                    choice = choices.setdefault(event.index, _Choice(self.parser))
                    yield choice.see(event)
                elif isinstance(event, ForkEvent):
                    parent = choices.setdefault(event.parent, _Choice(self.parser))
                    choices[event.index] = parent.copy()
                    yield event
                else:
                    yield event


class _Choice:
    """One choice's output as the parser needs it: ids and text so far, the ids whose text has
    not come yet (a detokenizer holding back), and per token whether it was thinking."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.ids: list[int] = []
        self.text = ""
        self.pending = 0  # the last ids, whose text is still to come
        self.thought: list[bool] = []  # per token: reasoning (the end marker included)
        self.thinking = True

    def copy(self) -> _Choice:
        twin = _Choice(self.parser)
        twin.ids, twin.text, twin.pending = list(self.ids), self.text, self.pending
        twin.thought, twin.thinking = list(self.thought), self.thinking
        return twin

    def see(self, event: TokenEvent | FinalEvent | BacktrackEvent) -> Event:
        if isinstance(event, TokenEvent):
            self.ids.append(event.token_id)
            self.pending += 1
            self.thought.append(self.thinking)
            if self.thinking:
                self.thinking = not self.parser.is_reasoning_end_streaming(
                    self.ids, self.ids[-1:])
            return self._split(event) if event.text else event
        if isinstance(event, BacktrackEvent):
            self._withdraw(event.count, event.text)
            return event
        event = self._split(event) if event.text else event
        usage = msgspec.structs.replace(event.usage, reasoning_tokens=sum(self.thought))
        return msgspec.structs.replace(event, usage=usage)

    def _split(self, event: TokenEvent | FinalEvent) -> TokenEvent | FinalEvent:
        delta = self.ids[len(self.ids) - self.pending:]
        previous = self.ids[:len(self.ids) - self.pending]
        message = self.parser.extract_reasoning_streaming(
            self.text, self.text + event.text, event.text, previous, self.ids, delta)
        self.text += event.text
        self.pending = 0
        if message is None:  # a marker alone
            return msgspec.structs.replace(event, text="", reasoning="")
        return msgspec.structs.replace(event, text=message.content or "",
                                       reasoning=message.reasoning or "")

    def _withdraw(self, count: int, text: str) -> None:
        """A controller took the last ``count`` tokens back: the state before them (their
        text is withdrawn as it was sent, docs/reasoning.md "Limits")."""
        keep = len(self.ids) - count
        del self.ids[keep:]
        del self.thought[keep:]
        self.text = self.text[:len(self.text) - len(text)] if text else self.text
        self.pending = max(0, self.pending - count)
        self.thinking = not self.ids or (self.thought[-1]
                                         and not self.parser.is_reasoning_end(self.ids))

"""The ``reasoning`` controller: a reasoning model thinks freely, then the request's own
controller takes over (docs/reasoning.md).

The engine host runs a reasoning model's request under it when the request bounds its
reasoning (``ReasoningOptions.max_tokens``) or brings a controller of its own (a tool call's or
a JSON schema's grammar): the grammar must start where the answer starts, not at the first
token of the thinking. ``controller_arg`` (``ReasoningArg``): the model's end-of-reasoning
marker as token ids, the budget, and the inner controller. While the model thinks nothing is
masked (but EOS, when an inner controller must still run: its answer is the point); when the
budget is spent the marker is forced; once the marker is in the output the inner controller
sees every call, as if the output had begun there.
"""

from __future__ import annotations

import msgspec
import numpy as np

from engines.controllers.api.base import Controller, ControllerContext, ControllerError, PreResult, json_arg

__all__ = ["InnerController", "ReasoningArg", "ReasoningController"]


class InnerController(msgspec.Struct, frozen=True):
    module: str
    arg: str = ""


class ReasoningArg(msgspec.Struct, frozen=True):
    end: list[int]  # the end-of-reasoning marker, as the model's token ids
    budget: int | None = None  # reasoning tokens before the marker is forced (None: no bound)
    inner: InnerController | None = None  # the request's own controller, run after the marker


class ReasoningController(Controller):
    def __init__(self, ctx: ControllerContext, arg: str, prompt: list[int]) -> None:
        super().__init__(ctx, arg, prompt)
        spec = json_arg("reasoning", arg, ReasoningArg,
                        'controller_arg is {"end": [ids], "budget": n, "inner": {...}}')
        if not spec.end or (spec.budget is not None and spec.budget < 0):
            raise ControllerError("reasoning: an end marker and a budget >= 0 are required")
        self.end, self.budget = list(spec.end), spec.budget
        self.thought: list[int] = []  # the output while reasoning, the marker included
        self.thinking = True
        # Built now, so a wrong grammar is refused before the model thinks; it sees no token
        # until the marker, as if the output began there.
        self.inner = None if spec.inner is None else _build(ctx, spec.inner, prompt)

    def pre_process(self) -> PreResult:
        if not self.thinking:
            return self.inner.pre_process() if self.inner is not None else PreResult()
        if self.budget is not None and len(self.thought) >= self.budget:
            return PreResult(ff_tokens=list(self.end))
        return PreResult()

    def mid_process(self) -> np.ndarray | None:
        if not self.thinking:
            return self.inner.mid_process() if self.inner is not None else None
        if self.inner is None:
            return None
        allowed = np.ones(self.ctx.tokenizer.vocab_size, dtype=bool)
        allowed[self.ctx.tokenizer.eos_token_id] = False
        return allowed

    def post_process(self, tokens: list[int], backtrack: int) -> bool:
        if not self.thinking:
            return self.inner.post_process(tokens, backtrack) if self.inner is not None else False
        if backtrack:
            del self.thought[len(self.thought) - backtrack:]
        start = len(self.thought)
        self.thought.extend(tokens)
        end = self._marker_end(start)
        if end is None:
            return False
        self.thinking = False
        answer, self.thought = self.thought[end:], self.thought[:end]
        if self.inner is None:
            return False
        self.inner.prompt = self.prompt + self.thought
        return self.inner.post_process(answer, 0) if answer else False

    def _marker_end(self, start: int) -> int | None:
        """Where the marker ends in the thought, if it ends at or after ``start``."""
        width = len(self.end)
        for stop in range(max(start + 1, width), len(self.thought) + 1):
            if self.thought[stop - width:stop] == self.end:
                return stop
        return None

    def fork(self, ctx: ControllerContext) -> Controller:
        twin = object.__new__(ReasoningController)
        twin.__dict__.update(self.__dict__)
        twin.ctx, twin.prompt, twin.thought = ctx, list(self.prompt), list(self.thought)
        twin.inner = None if self.inner is None else self.inner.fork(ctx)
        return twin

    def forked(self, index: int) -> None:
        if self.inner is not None:
            self.inner.forked(index)


def _build(ctx: ControllerContext, inner: InnerController, prompt: list[int]) -> Controller:
    factory = ctx.controllers(inner.module)
    if factory is None or inner.module == "reasoning":
        raise ControllerError(f"reasoning: unknown controller {inner.module!r}")
    return factory(ctx, inner.arg, list(prompt))

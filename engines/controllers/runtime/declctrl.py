"""``declctrl``: AICI's declarative controller, for programs in the JSON shape AICI's Python
client (``pyaici.ast``) emits: ``{"steps": [{"Fixed": ...}, {"Gen": ...}, ...]}``.

Written from AICI's documented behaviour (``docs/protocols/aici.md``; microsoft/aici's declctrl and
its test-suite), on this runtime's three phases:

- ``Fixed`` (``text`` expression, ``label``, ``following``, ``stmts``): its text, tokenized
  alone, is forced (fast-forward). ``following: L`` first withdraws everything from the start
  of the step labelled ``L`` (backtrack), so the text replaces that step and what came after.
- ``Gen`` (``rx``, ``stop_at``, ``max_tokens`` / ``max_words`` / ``max_bytes``, ``stmts``):
  sampling, masked by llguidance when ``rx`` is given (the step's own text must match it
  whole). It must end at a limit, once ``stop_at`` appeared (kept in the text), or when the
  regex can take nothing more. A step that *may* end allows, as in AICI, the first token of a
  ``Fixed`` that follows (the model picking it moves on), and also EOS, which ends the step
  and is withdrawn (kept only at the program's end). With ``stop_at``, only the stop string
  or a limit ends it.
- ``Gen.inner`` (``[{"after": text, "options": list expression}]``, without ``rx``): free text
  (no EOS) until the output ends with an ``after`` text; then the text must continue with one
  of the options (those that begin with what the token that completed ``after`` already
  added), token by token, forced once only one remains (AICI's derived ``Options`` step);
  after an option, free text again.
- ``Choose`` (``options``: a list expression): the text is one of the options.
- ``Stop``, and the end of the steps: the controller stops.
- ``Fork`` (``branches``: two or more non-empty step lists): the sequence forks into one per
  branch; each runs its branch's steps, then the steps after the ``Fork``. A ``Gen`` or
  ``Choose`` right before a ``Fork`` moves on to it as soon as it may end (AICI's greedy rule).
- ``Wait`` (``vars``): the sequence is suspended until every listed variable is set (by any
  fork of the request: they share their variables).
- Expressions evaluate to bytes: ``String``, ``Var`` (unset: empty), ``Current`` (the step's
  own text, in ``stmts``), ``Concat`` (``list``: joined by AICI's separator U+FF0C),
  ``IfEq``, ``Extract`` (``$1``-style templates; ``list``: all matches).
- ``Set`` statements run when their step ends; each write is a ``WriteVar`` storage entry.

The program's parsing and its expressions: ``engines/controllers/runtime/declctrl_program.py``.
Refused with a clear error: ``yacc``. ``mask_tags`` and ``tag`` are accepted and have
no effect (as in AICI).
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
import numpy as np

from engines.controllers.api.base import Controller, ControllerContext, PreResult
from engines.controllers.runtime.declctrl_program import SEP, Step, evaluate, fail, parse

__all__ = ["DeclController", "SEP"]

_WORD_END = re.compile(rb"\S\s")

class DeclController(Controller):
    def __init__(self, ctx: ControllerContext, arg: str, prompt: list[int]) -> None:
        super().__init__(ctx, arg, prompt)
        self.steps = parse(arg)
        self.eos = ctx.tokenizer.eos_token_id
        self.out: list[int] = []  # the output as this controller sees it
        self.labels: dict[str, int] = {}  # label → where its step's tokens start in out
        self.idx = 0
        self.start = 0  # where the current step's tokens start in out
        self.entered = False
        self.withdraw = 0  # a step-ending EOS still in out, to withdraw with the next edit
        self.forcing: list[int] | None = None  # a Fixed's tokens, until they come back
        self.matcher: llguidance.LLMatcher | None = None
        self._next_tokens: list[int] | None = None  # the next Fixed's, once asked for
        # Gen.inner: after an ``after`` text, the options' tokens still possible, and how many
        # of their tokens are in the output (None: free text)
        self.inner: list[list[int]] | None = None
        self.inner_at = 0
        self._compiled = self._compile_regexes()

    @property
    def step(self) -> Step:
        return self.steps[self.idx]

    def _where(self) -> str:
        return self.step.where or f"step {self.idx}"

    # --- phases ------------------------------------------------------------------------------

    def pre_process(self) -> PreResult:
        while True:
            step = self.step
            if step.kind == "Stop":
                return PreResult(num_forks=0)
            if step.kind in ("Fork", "Wait") and self.withdraw:  # the EOS that ended the step
                backtrack, self.withdraw = self.withdraw, 0
                return PreResult(backtrack=backtrack)
            if step.kind == "Fork":
                return PreResult(num_forks=len(step.branches))
            if step.kind == "Wait":
                missing = [n for n in step.spec["vars"] if self.ctx.get_var(n) is None]
                if missing:
                    return PreResult(suspend=True)
                self._begin(len(self.out))
                self._finish()
                continue
            if step.kind != "Fixed":
                break
            if self.forcing is not None:  # started by the model (its first token): the rest
                return PreResult(ff_tokens=self.forcing[len(self.out) - self.start:])
            backtrack = self.withdraw
            following = step.spec.get("following")
            if following is not None:
                if following not in self.labels:
                    raise fail(self._where(), f"no step labelled {following!r} before it")
                backtrack = len(self.out) - self.labels[following]
            self._begin(len(self.out) - backtrack)
            text = self._eval(step.spec["text"], b"").decode("utf-8", errors="replace")
            self.forcing = self.ctx.tokenizer.encode(text)
            self.withdraw = 0
            if self.forcing or backtrack:
                return PreResult(backtrack=backtrack, ff_tokens=list(self.forcing))
            self._finish()  # empty text (an unset variable): nothing to force, next step
        if not self.entered:
            self._begin(len(self.out) - self.withdraw)
            self._enter(step)
        if self.withdraw:  # the EOS that ended the previous step
            backtrack, self.withdraw = self.withdraw, 0
            return PreResult(backtrack=backtrack)
        if self.inner is not None:  # one option left with 2+ tokens to go: forced (as AICI)
            longer = [o for o in self.inner if len(o) >= self.inner_at + 2]
            if len(longer) == 1:
                return PreResult(ff_tokens=longer[0][self.inner_at:])
        if self.steps[self.idx + 1].kind == "Fork" and self._may_end():
            self._finish()  # AICI moves to a Fork as soon as the step before it may end
            return self.pre_process()
        return PreResult()

    def forked(self, index: int) -> None:
        step = self.step
        if step.kind != "Fork":
            raise fail(self._where(), "forked outside a Fork step")
        self.ctx.log(f"fork: branch {index} of {len(step.branches)}")
        self.steps[self.idx:self.idx + 1] = step.branches[index]
        self.entered = False

    def fork(self, ctx: ControllerContext) -> DeclController:
        # llguidance's matchers are not deep-copyable: copied with their own deep_copy()
        matcher, compiled = self.matcher, self._compiled
        self.matcher, self._compiled = None, {}
        try:
            child = super().fork(ctx)
        finally:
            self.matcher, self._compiled = matcher, compiled
        assert isinstance(child, DeclController)
        child.matcher = matcher.deep_copy() if matcher is not None else None
        child._compiled = {uid: m.deep_copy() for uid, m in compiled.items()}
        return child

    def mid_process(self) -> np.ndarray | None:
        if self.step.kind not in ("Gen", "Choose"):
            return None
        if self.inner is not None:
            allowed = np.zeros(self.ctx.tokenizer.vocab_size, dtype=bool)
            if any(len(o) <= self.inner_at for o in self.inner):
                allowed[:] = True  # an option is complete: free text may go on, as in AICI
                allowed[self.eos] = False
            for option in self.inner:
                if len(option) > self.inner_at:
                    allowed[option[self.inner_at]] = True
            return allowed
        may_end = self._may_end()
        start = self._next_fixed() if may_end else None
        if self.matcher is not None:
            words = np.frombuffer(self.matcher.compute_bitmask(), dtype="<u4").copy()
            if not may_end:  # llguidance allows EOS wherever the regex accepts
                words[self.eos // 32] &= ~np.uint32(1 << (self.eos % 32))
            if start:
                words[start[0] // 32] |= np.uint32(1 << (start[0] % 32))
            return words
        if may_end:
            return None
        allowed = np.ones(self.ctx.tokenizer.vocab_size, dtype=bool)
        allowed[self.eos] = False
        return allowed

    def post_process(self, tokens: list[int], backtrack: int) -> bool:
        if backtrack:
            del self.out[len(self.out) - backtrack:]
            self.labels = {k: v for k, v in self.labels.items() if v <= len(self.out)}
        for token in tokens:
            if self.step.kind == "Stop":
                break
            if self.step.kind in ("Fork", "Wait"):  # not sampled for: kept, as AICI ignores it
                self.out.append(token)
                continue
            if self.step.kind == "Fixed":
                self.out.append(token)
                if len(self.out) - self.start >= len(self.forcing or ()):
                    self._finish()
                continue
            start = self._next_fixed() if self._may_end() and self.inner is None else None
            self.out.append(token)
            if token == self.eos:
                self.withdraw = 1  # ends the step; not part of its text
                self._finish(eos=True)
            elif start and token == start[0]:
                # The model began the next (Fixed) step: this one ends before that token, as
                # AICI's "furthest step that accepts the token" does.
                self.out.pop()
                self._finish()
                self._begin(len(self.out))
                self.forcing = start
                self.out.append(token)
                if len(start) == 1:
                    self._finish()
            else:
                self._advance_gen(token)
        if self.step.kind == "Fixed" and self.forcing == []:
            self._finish()  # empty text: nothing comes back
        return self.step.kind == "Stop"

    # --- steps -------------------------------------------------------------------------------

    def _begin(self, start: int) -> None:
        self.start = start
        if self.step.label:
            self.labels[self.step.label] = start

    def _enter(self, step: Step) -> None:
        self.entered = True
        self.matcher = None
        if step.kind == "Choose":
            options = [o for o in self._eval(step.spec["options"], b"").split(SEP)]
            if options and options[-1] == b"":
                options.pop()
            if not options:
                raise fail(self._where(), "Choose has no options")
            lark = " | ".join(json.dumps(o.decode("utf-8", errors="replace"),
                                         ensure_ascii=False) for o in options)
            self.matcher = self._matcher(llguidance.LLMatcher.grammar_from_lark("start: " + lark))
        elif step.spec.get("rx") is not None:
            self.matcher = self._compiled.pop(step.uid)

    def _compile_regexes(self) -> dict[int, llguidance.LLMatcher]:
        """Every Gen's regex, compiled while the controller is built (under the runtime's
        init bound, not a step's)."""
        compiled = {}
        pending = list(self.steps)
        while pending:
            step = pending.pop()
            pending.extend(s for branch in step.branches for s in branch)
            if step.kind == "Gen" and step.spec.get("rx") is not None:
                # The step's whole text matches: AICI anchors both ends.
                rx = step.spec["rx"].removeprefix("^")
                rx = rx[:-1] if rx.endswith("$") and not rx.endswith("\\$") else rx
                compiled[step.uid] = self._matcher(llguidance.LLMatcher.grammar_from_regex(rx),
                                                   step.where)
        return compiled

    def _matcher(self, grammar: str, where: str | None = None) -> llguidance.LLMatcher:
        tok = self.ctx.tokenizer.llg  # type: ignore[attr-defined]
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise fail(where or self._where(), matcher.get_error())
        return matcher

    def _next_fixed(self) -> list[int] | None:
        """The tokens of the next step when it is a Fixed the model may start right here
        (AICI's mask for a step that may end includes the next step's first token). Its text
        is taken now: variables this step sets are not written yet (as in AICI)."""
        following = self.steps[self.idx + 1]
        if following.kind != "Fixed" or following.spec.get("following") is not None:
            return None
        if self._next_tokens is None:
            text = self._eval(following.spec["text"], b"").decode("utf-8", errors="replace")
            self._next_tokens = self.ctx.tokenizer.encode(text)
        return self._next_tokens or None

    def _text(self) -> bytes:
        return self.ctx.tokenizer.decode(self.out[self.start:])

    def _may_end(self) -> bool:
        spec = self.step.spec
        if spec.get("stop_at"):
            return False  # only the stop string (or a limit) ends it
        if self.matcher is not None:
            return self.matcher.is_accepting()
        return len(self.out) > self.start

    def _advance_gen(self, token: int) -> None:
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise fail(self._where(), f"token {token} outside the step's constraint: "
                                            f"{self.matcher.get_error()}")
        spec, text = self.step.spec, self._text()
        if spec.get("inner"):
            self._advance_inner(token, spec["inner"])
        stop_at = spec.get("stop_at")
        done = (stop_at and stop_at.encode() in text[-(len(stop_at.encode())
                                                       + len(self.ctx.tokenizer.decode([token]))):])
        done = done or (spec.get("max_tokens") and len(self.out) - self.start >= spec["max_tokens"])
        done = done or (spec.get("max_bytes") and len(text) >= spec["max_bytes"])
        done = done or (spec.get("max_words") and
                        len(_WORD_END.findall(text)) >= spec["max_words"])
        if self.matcher is not None and self.matcher.is_stopped():
            done = True  # nothing can follow (a stop string not seen yet never will be)
        if done:
            self._finish()

    def _advance_inner(self, token: int, constraints: list[dict]) -> None:
        if self.inner is not None:
            if any(len(o) <= self.inner_at for o in self.inner):
                # An option is complete: free text takes the token (AICI's furthest step
                # that accepts it), even one that would go on with a longer option.
                self.inner = None
            else:
                going = [o for o in self.inner if o[self.inner_at] == token]
                self.inner_at += 1
                self.inner = going if any(len(o) > self.inner_at for o in going) else None
                return
        piece = self.ctx.tokenizer.decode([token])
        for constraint in constraints:
            after = constraint["after"].encode()
            # the output's tail: enough tokens to hold ``after`` ending in this token
            tail = self.ctx.tokenizer.decode(self.out[-(len(after) + 1):])
            # ``after`` must end inside this token's text
            found = tail.find(after, max(0, len(tail) - len(piece) - len(after) + 1))
            if found < 0:
                continue
            typed = tail[found + len(after):]  # what this token added past ``after``
            options = [o for o in self._eval(constraint["options"], b"").split(SEP)
                       if o and o.startswith(typed)]
            # an option this token already completed stays, empty: free text may follow it
            tokens = [self.ctx.tokenizer.encode(o[len(typed):].decode("utf-8", errors="replace"))
                      if len(o) > len(typed) else [] for o in options]
            if tokens:
                self.inner, self.inner_at = tokens, 0
                self.ctx.log(f"inner: after {constraint['after']!r}, {len(tokens)} options")
            return

    def _finish(self, eos: bool = False) -> None:
        current = self.ctx.tokenizer.decode(self.out[self.start:len(self.out) - eos])
        step = self.step
        self.ctx.log(f"finish: {step.kind} {current.decode('utf-8', errors='replace')!r}")
        for stmt in step.stmts:
            name, value = stmt["Set"]["var"], self._eval(stmt["Set"]["expr"], current)
            self.ctx.set_var(name, value)
            self.ctx.log(f"  set ${name} := {value.decode('utf-8', errors='replace')!r}")
        self.idx += 1
        self.entered, self.forcing, self.matcher, self._next_tokens = False, None, None, None
        self.inner, self.inner_at = None, 0

    def _eval(self, expr: Any, current: bytes) -> bytes:
        return evaluate(expr, current, self.ctx.get_var, self._where())

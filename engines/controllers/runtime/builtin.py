"""Built-in controllers, exposed as tags: ``none``, ``llguidance`` and ``declctrl``
(``engines/controllers/runtime/declctrl.py``).

``HFTokenizerInfo`` gives controllers the model's tokenizer: the HF fast tokenizer for text, the
llguidance tokenizer built from it (once, ~1 s on a large vocabulary) for grammars.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
import llguidance.hf
import msgspec
import numpy as np

from engines.controllers.api.base import (
    Controller,
    ControllerContext,
    ControllerError,
    PreResult,
    json_arg,
)
from engines.controllers.runtime.declctrl import DeclController
from engines.controllers.runtime.reasoning import ReasoningController

__all__ = ["BUILTIN_CONTROLLERS", "GuidanceController", "HFTokenizerInfo", "NoneController"]


class HFTokenizerInfo:
    """:class:`~engines.controllers.api.base.TokenizerInfo` over a Hugging Face fast tokenizer.

    ``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int | None = None) -> None:
        self.hf = hf_tokenizer
        self.vocab_size = int(vocab_size or len(hf_tokenizer))
        eos = hf_tokenizer.eos_token_id
        self.eos_token_id = int(eos[0] if isinstance(eos, list) else eos)
        self._llg: llguidance.LLTokenizer | None = None
        self._llg_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, model_dir: str, vocab_size: int | None = None) -> HFTokenizerInfo:
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(model_dir), vocab_size)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> bytes:
        return self.llg.decode_bytes(list(tokens))

    @property
    def llg(self) -> llguidance.LLTokenizer:
        with self._llg_lock:
            if self._llg is None:
                self._llg = llguidance.hf.from_tokenizer(self.hf, n_vocab=self.vocab_size)
            return self._llg


class NoneController(Controller):
    """Plain generation: every token allowed; only ``max_tokens`` ends it (EOS is ignored)."""


class GuidanceArg(msgspec.Struct):
    grammar: dict[str, Any] | str


class GuidanceController(Controller):
    """``controller_arg = {"grammar": <llguidance TopLevelGrammar>}``: Lark, regex or JSON schema
    grammars. Masks come from llguidance; the tokens the grammar forces are fast-forwarded; the
    sequence stops when the grammar is complete (llguidance then allows only EOS)."""

    def __init__(self, ctx: ControllerContext, arg: str, prompt: list[int]) -> None:
        super().__init__(ctx, arg, prompt)
        grammar = json_arg("llguidance", arg, GuidanceArg,
                           'controller_arg is {"grammar": <TopLevelGrammar>}').grammar
        grammar = grammar if isinstance(grammar, str) else json.dumps(grammar)
        tok = ctx.tokenizer.llg
        error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise ControllerError(f"llguidance: {error}")
        self.matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ControllerError(f"llguidance: {self.matcher.get_error()}")

    def pre_process(self) -> PreResult:
        if self.matcher.is_stopped():
            return PreResult(num_forks=0)
        ff = self.matcher.compute_ff_tokens()
        self._check()
        return PreResult(ff_tokens=list(ff))

    def mid_process(self) -> np.ndarray:
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype="<i4")
        self._check()
        return words

    def post_process(self, tokens: list[int], backtrack: int) -> bool:
        if backtrack and not self.matcher.rollback(backtrack):
            self._check()
        # The grammar's end: EOS is accepted only there, and stops the sequence.
        if not self.matcher.consume_tokens(list(tokens)):
            self._check()
        return self.matcher.is_stopped()

    def fork(self, ctx: ControllerContext) -> Controller:
        twin = object.__new__(GuidanceController)
        twin.__dict__.update(self.__dict__)
        twin.ctx, twin.prompt, twin.matcher = ctx, list(self.prompt), self.matcher.deep_copy()
        return twin


BUILTIN_CONTROLLERS = {"none": NoneController, "llguidance": GuidanceController,
                       "declctrl": DeclController, "reasoning": ReasoningController}

"""An operator's controller, as the Serve config registers one (``controllers.custom``):

    models:
      - name: smollm2-135m-instruct
        controllers:
          custom: {redact: "engines.controllers.api.examples:Redact"}

Requests then name it like a built-in: ``"controller": "redact"``, ``"controller_arg":
{"words": ["Paris"], "replacement": "[redacted]"}`` (OpenAI extra body, AICI's ``/v1/run``,
TGI / LMI / MindIE ``parameters``, LMTP). Controllers are trusted code: they run in the
replica's controller runtime with its permissions.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from engines.controllers.api.base import Controller, ControllerContext, PreResult, json_arg

__all__ = ["Redact"]


class RedactArg(msgspec.Struct):
    words: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(min_length=1)]
    replacement: Any = "[redacted]"  # written as text, whatever JSON value it is


class Redact(Controller):
    """Whenever the output ends with one of ``words``, withdraw the tokens that spell it
    (backtrack) and force ``replacement`` in their place (fast-forward); generation then goes
    on after the replacement as if the model had written it."""

    def __init__(self, ctx: ControllerContext, arg: str, prompt: list[int]) -> None:
        super().__init__(ctx, arg, prompt)
        spec = json_arg("redact", arg, RedactArg,
                        'controller_arg is {"words": [non-empty strings], "replacement": str}')
        self.words = [w.encode() for w in spec.words]
        self.replacement = str(spec.replacement)
        self.out: list[int] = []

    def post_process(self, tokens: list[int], backtrack: int) -> bool:
        if backtrack:
            del self.out[-backtrack:]
        self.out += tokens
        return False

    def pre_process(self) -> PreResult:
        text = self.ctx.tokenizer.decode(self.out)
        word = next((w for w in self.words if text.endswith(w)), None)
        if word is None:
            return PreResult()
        # The fewest trailing tokens whose bytes cover the word; what they hold before the
        # word is forced back unchanged (a token may start with a space or end a word before).
        count = next(n for n in range(1, len(self.out) + 1)
                     if len(self.ctx.tokenizer.decode(self.out[-n:])) >= len(word))
        withdrawn = self.ctx.tokenizer.decode(self.out[-count:])
        keep = withdrawn[:len(withdrawn) - len(word)].decode("utf-8", errors="replace")
        self.ctx.log(f"redact: {word.decode(errors='replace')!r} withdrawn ({count} tokens)")
        return PreResult(backtrack=count,
                         ff_tokens=self.ctx.tokenizer.encode(keep + self.replacement))

"""Incremental detokenization: the text each new token adds to a sequence.

The one home of the sliding-window decoder every engine kind uses (vLLM's translator for
``TokenEvent.piece``, the controlled run's forced tokens, the pipeline's output text). Each
token's text is the difference between decoding a short window with and without it; the window
starts in the tokens before the first new one (the prompt's or the output's tail), so tokenizers
that drop a leading space on a sequence's first token still see context, and a character split
across tokens (the decode ends in U+FFFD) waits for the token that completes it, as vLLM's and
TGI's detokenizers do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDecoder"]

_KEEP = 64  # tokens before the window that are dropped at once (the window never needs them)


class IncrementalDecoder:
    def __init__(self, tokenizer: Any, context: Sequence[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(context)
        self._prefix, self._read = 0, len(self._ids)

    def add(self, token_id: int) -> str:
        """Append ``token_id``; the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix: self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > _KEEP:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return after[len(before):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

"""Incremental detokenization and stop strings for one output sequence.

Text is decoded in a short sliding window that starts in the prompt's tail (tokenizers that drop
a leading space on a sequence's first token still see context; vLLM and TGI do the same), and a
step's text is held back while it could be the start of a stop string, as vLLM does, so a
client never receives text that a stop string later cuts.
"""

from __future__ import annotations

from typing import Any

from engines.kit.detokenize import IncrementalDecoder

__all__ = ["OutputText"]


class OutputText:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool,
                 stops: tuple[str, ...], include_stop: bool):
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.decoder = IncrementalDecoder(tokenizer, prompt_ids[-5:], skip_special_tokens)
        self.text = ""  # the output text so far (cut at a stop string once one matched)
        self.emitted = 0  # characters of ``text`` already handed out as deltas

    def add(self, token_id: int, check_stops: bool = True) -> tuple[str, str, str | None]:
        """Append a token: (its piece of text, the delta to send now, the stop string it
        completed or None). ``check_stops`` False: text before ``min_tokens`` is out, which
        stop strings don't end (vLLM)."""
        piece = self.decoder.add(token_id)
        scan_from = max(0, len(self.text) - self.hold)
        self.text += piece
        for stop in self.stops if check_stops else ():
            at = self.text.find(stop, scan_from)
            if at >= 0:
                self.text = self.text[: at + (len(stop) if self.include_stop else 0)]
                return piece, self._delta(len(self.text)), stop
        return piece, self._delta(len(self.text) - self.hold if self.stops else len(self.text)), None

    def piece(self, token_id: int) -> str:
        """The text ``token_id`` adds, without adding it to the output (a stop token's)."""
        return self.decoder.add(token_id)

    def flush(self) -> str:
        """What was held back, at the end of the sequence."""
        return self._delta(len(self.text))

    def _delta(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted: upto]
        self.emitted = upto
        return delta

"""Controllers on the ``pipeline`` kind (``docs/controllers.md``, "Controllers on the pipeline
kind").

A controlled request runs as segments, driven by the same frontend as on the ``vllm`` kind
(``engines.controllers.run.ControlledRun``): each segment is one sequence through the pipe,
whose every step asks the runtime (:class:`StepHook`, on the origin's thread) with the token it
sampled last, its binding on the first step, and for its mask. A step that ends the segment
(the controller stopped, failed or asks for an edit) allows only EOS, which ends the sequence;
the frontend then asks the runtime what comes next and starts the next segment from the output
so far.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from engines.controllers.channels import MainClient, RuntimeReplyError
from engines.controllers.masks import bits_to_bias
from engines.controllers.messages import MidOp, PostOp, PreOp, StepAnswer, read
from engines.controllers.run import Segment
from engines.controllers.shm import BiasMatrix, ChannelError
from protocols.internal import FinalEvent, GenerateRequest

__all__ = ["SegmentRow", "StepHook", "note_finish", "segment_request"]

log = logging.getLogger(__name__)
# A runtime that does not answer within this is gone (each controller call has its own, far
# shorter bound): this row ends, and so does every later controlled row.
CHANNEL_TIMEOUT_S = 5.0


@dataclass
class SegmentRow:
    """One segment as the hook tracks it: its sequence id and controller (the frontend's
    binding), how many of its tokens the runtime has heard of, whether it is bound yet."""

    seq: int
    req_id: str
    reported: int  # tokens of the sequence (prompt and output) the controller has
    bound: bool = False


class StepHook:
    """The engine end of the runtime's main channel for a pipeline replica. ``step`` is
    called on the origin's thread only (the main channel carries one command at a time)."""

    def __init__(self, prefix: str, vocab_size: int, eos: int) -> None:
        self._main = MainClient(prefix, create=False)
        self._bias = BiasMatrix(prefix, create=False)
        self._vocab, self._eos = vocab_size, eos
        self._dead = ""

    def close(self) -> None:
        self._main.close()
        self._bias.close()

    def step(self, row: SegmentRow, tokens: list[int]) -> Any:
        """The additive bias (``[vocab]`` float32: 0 allowed, -inf banned) for this step of
        ``row`` whose sequence is ``tokens`` now, or None when it is unconstrained."""
        if self._dead:
            return self._only_eos()
        new, row.reported = tokens[row.reported:], len(tokens)
        command = {"post_ops": [PostOp(id=row.seq, tokens=new, backtrack=0)] if new else [],
                   "pre_ops": [] if row.bound else [PreOp(id=row.seq, req_id=row.req_id)],
                   "freed": [], "mid_ops": [MidOp(id=row.seq)], "mask_format": "bits"}
        row.bound = True
        try:
            answer = read(self._main.call("step", CHANNEL_TIMEOUT_S, **command), StepAnswer)
        except ChannelError as exc:
            self._dead = f"controller runtime unreachable: {exc}"
            log.error("%s; ending every controlled sequence", self._dead)
            return self._only_eos()
        except (RuntimeReplyError, msgspec.ValidationError) as exc:
            log.error("controller runtime refused a step (%s); ending its sequence", exc)
            return self._only_eos()
        if row.seq in answer.ends():
            return self._only_eos()
        if answer.mid.ids != [row.seq] or 0 in answer.mid.unmasked:
            return None
        import torch

        bias = bits_to_bias(self._bias.words(1, self._vocab))[0, :self._vocab]
        return torch.from_numpy(bias)

    def _only_eos(self) -> Any:
        import torch

        bias = torch.full((self._vocab,), float("-inf"))
        bias[self._eos] = 0.0
        return bias


def segment_request(request: GenerateRequest, eos: int) -> GenerateRequest:
    """A segment's request: EOS ends it whatever the model's own rule (the first stop id),
    and only the controller or the budget ends the run (no ``min_tokens`` of its own)."""
    s = request.sampling
    stop_ids = (eos, *(t for t in s.stop_token_ids if t != eos))
    sampling = msgspec.structs.replace(s, ignore_eos=True, stop_token_ids=stop_ids,
                                       min_tokens=0)
    return msgspec.structs.replace(request, sampling=sampling)


def note_finish(segment: Segment, final: FinalEvent) -> None:
    """How a segment's sequence ended, in the terms the frontend reads (vLLM's)."""
    if final.finish_reason == "stop_sequence" and isinstance(final.stop_reason, int):
        segment.finish, segment.stop_reason = "stop", final.stop_reason
    elif final.finish_reason == "length":
        segment.finish = "length"
    else:
        segment.finish = "abort"

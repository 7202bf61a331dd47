"""Controllers on the ``pipeline`` kind (``docs/controllers.md``, "Controllers on the pipeline
kind").

A controlled request runs as segments, driven by the same frontend as on the ``vllm`` kind
(``engines.controllers.driver.run.ControlledRun``): each segment is one sequence through the pipe,
whose every step asks the runtime (:class:`StepHook`, on the origin's thread, once for every
controlled sequence of a micro-batch) with the token it sampled last, its binding on the first
step, and for its mask. A step that ends the segment
(the controller stopped, failed or asks for an edit) allows only EOS, which ends the sequence;
the frontend then asks the runtime what comes next and starts the next segment from the output
so far.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from contract import FinalEvent, GenerateRequest
from engines.controllers.api.masks import bits_to_bias
from engines.controllers.driver.run import Segment
from engines.controllers.ipc.channels import MainClient, RuntimeReplyError
from engines.controllers.ipc.messages import MidOp, PostOp, PreOp, StepAnswer, read
from engines.controllers.ipc.shm import BiasMatrix, ChannelError

__all__ = ["SegmentRow", "StepHook", "note_finish", "segment_request"]

log = logging.getLogger(__name__)
# A runtime that does not answer within this is gone (each controller call has its own, far
# shorter bound): this row ends, and so does every later controlled row.
CHANNEL_TIMEOUT_S = 5.0


@dataclass
class SegmentRow:
    """One segment as the hook tracks it: its sequence id and controller (the frontend's
    binding), how many of its tokens the runtime has heard of, whether it is bound yet, and
    this step's mask once asked (:meth:`StepHook.ask`)."""

    seq: int
    req_id: str
    reported: int  # tokens of the sequence (prompt and output) the controller has
    bound: bool = False
    asked: bool = False  # ``mask`` is this step's
    mask: Any = None


class StepHook:
    """The engine end of the runtime's main channel for a pipeline replica, used on the
    origin's thread only (the channel carries one command at a time): before a micro-batch's
    sequences sample, :meth:`ask` asks for every controlled one of them in one round trip, as
    vLLM's hook does for its batch; :meth:`mask` hands a row its mask as it samples."""

    def __init__(self, prefix: str, vocab_size: int, eos: int) -> None:
        self._main = MainClient(prefix, create=False)
        self._bias = BiasMatrix(prefix, create=False)
        self._vocab = vocab_size
        self._dead = ""
        import torch

        # The mask of a row whose sequence ends this step (shared: the sampler only adds it).
        self._only_eos = torch.full((vocab_size,), float("-inf"))
        self._only_eos[eos] = 0.0

    def close(self) -> None:
        self._main.close()
        self._bias.close()

    def mask(self, row: SegmentRow, tokens: list[int]) -> Any:
        """``row``'s additive bias for this step (``[vocab]`` float32: 0 allowed, -inf
        banned; None when unconstrained), its sequence being ``tokens`` now."""
        if not row.asked:  # not in a micro-batch's ask (a step the origin took alone)
            self.ask([(row, tokens)])
        row.asked = False
        return row.mask

    def ask(self, rows: list[tuple[SegmentRow, list[int]]]) -> None:
        """One ``step`` for ``rows`` (each with its sequence's tokens now): the tokens each
        sampled since it was last told, the bindings of new ones, and every row's mask."""
        for row, _ in rows:
            row.asked, row.mask = True, None
        if self._dead:
            return self._end([row for row, _ in rows])
        answer = self._step(rows)
        if answer is None:
            return self._end([row for row, _ in rows])
        ends = answer.ends()
        self._end([row for row, _ in rows if row.seq in ends])
        ids = answer.mid.ids if isinstance(answer.mid.ids, list) else []
        unmasked = set(answer.mid.unmasked)
        masked = [k for k in range(len(ids)) if k not in unmasked]
        if not masked:
            return None
        import torch

        bias = bits_to_bias(self._bias.words(len(ids), self._vocab))[:, :self._vocab]
        by_seq = {row.seq: row for row, _ in rows}
        for k in masked:
            row = by_seq.get(ids[k])
            if row is not None and row.seq not in ends:
                row.mask = torch.from_numpy(bias[k])
        return None

    def _step(self, rows: list[tuple[SegmentRow, list[int]]]) -> StepAnswer | None:
        post_ops, pre_ops = [], []
        for row, tokens in rows:
            if not row.bound:
                pre_ops.append(PreOp(id=row.seq, req_id=row.req_id))
                row.bound = True
            new, row.reported = tokens[row.reported:], len(tokens)
            if new:
                post_ops.append(PostOp(id=row.seq, tokens=new, backtrack=0))
        try:
            data = self._main.call("step", CHANNEL_TIMEOUT_S, post_ops=post_ops, pre_ops=pre_ops,
                                   freed=[], mid_ops=[MidOp(id=row.seq) for row, _ in rows],
                                   mask_format="bits")
            return read(data, StepAnswer)
        except ChannelError as exc:
            self._dead = f"controller runtime unreachable: {exc}"
            log.error("%s; ending every controlled sequence", self._dead)
        except (RuntimeReplyError, msgspec.ValidationError) as exc:
            log.error("controller runtime refused a step (%s); ending its sequences", exc)
        return None

    def _end(self, rows: list[SegmentRow]) -> None:
        """Only EOS for these rows this step: their sequences end."""
        for row in rows:
            row.mask = self._only_eos


def segment_request(request: GenerateRequest, eos: int, seq: int) -> GenerateRequest:
    """Segment ``seq``'s request: an id of its own (forked branches run at once, each its own
    sequence in the pipe), EOS ends it whatever the model's own rule (the first stop id), and
    only the controller or the budget ends the run (no ``min_tokens`` of its own)."""
    s = request.sampling
    stop_ids = (eos, *(t for t in s.stop_token_ids if t != eos))
    sampling = msgspec.structs.replace(s, ignore_eos=True, stop_token_ids=stop_ids,
                                       min_tokens=0)
    return msgspec.structs.replace(request, request_id=f"{request.request_id}-s{seq}",
                                   sampling=sampling)


def note_finish(segment: Segment, final: FinalEvent) -> None:
    """How a segment's sequence ended, in the terms the frontend reads (vLLM's)."""
    if final.finish_reason == "stop_sequence" and isinstance(final.stop_reason, int):
        segment.finish, segment.stop_reason = "stop", final.stop_reason
    elif final.finish_reason == "length":
        segment.finish = "length"
    else:
        segment.finish = "abort"

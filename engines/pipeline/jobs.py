"""What the origin's scheduler (``engines.pipeline.origin``) runs: one :class:`Job` per sequence,
the step function that samples it, and the failures that end it
(docs/protocols/pipeline.md, "Batching")."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Job", "PipelineFailure", "Sequence", "StageTimeout", "StepFn", "lost_on_the_way"]


class StageTimeout(RuntimeError):
    """A micro-batch did not come back from the stages in time (a hung stage): restart path."""


class PipelineFailure(RuntimeError):
    """A sequence lost its stages more often than ``max_restarts`` allows."""


@dataclass
class Sequence:
    """One sequence as the origin tracks it: every token (prompt and output) and how many of
    them were sent into the pipe (the stages' guards check what they hold)."""

    seq_id: str
    tokens: list[int]
    sent: int = 0
    restarts: int = 0


# On the origin thread: the last position's logits ``[vocab]`` (float32) and, on a job's first
# step when it asked for ``every``, the hidden states of every prompt position (chunks
# ``[1, n, H]``, in order) → what to deliver, and whether the sequence is done. It appends the
# next token to ``seq.tokens`` when it goes on.
StepFn = Callable[[Any, list[Any] | None], tuple[Any, bool]]


@dataclass(eq=False)
class Job:
    """One sequence as the scheduler drives it (see :data:`StepFn`)."""

    seq: Sequence
    step: StepFn
    every: bool = False
    outbox: deque = field(default_factory=deque)  # (payload, done) results, or an exception
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    prompt_hidden: list[Any] = field(default_factory=list)
    epoch: int = 0  # restarts: results of micro-batches sent before one are void
    stepped: bool = False
    parked: bool = False  # its outbox is full: not waiting until the reader takes one
    closed: bool = False
    control: Any = None  # a controlled sequence's row, for the origin's ``before_steps``


def lost_on_the_way(sent: set[str], returned: tuple[str, ...],
                    dropped: dict[str, str]) -> dict[str, str]:
    """The sequences of a micro-batch to restart (id → why): those a stage dropped, and any it
    sent the micro-batch on without (never left waiting for a step that will not come)."""
    missing = sent - set(returned) - set(dropped)
    return {**dropped, **{seq_id: "a stage sent the micro-batch on without it"
                          for seq_id in sorted(missing)}}

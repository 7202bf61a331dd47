"""What a branch of a controlled run does next (``engines/controllers/driver/run.py``): one decision per
answer of the controller, as a value, so the driver's loop reads as the list of cases."""

from __future__ import annotations

from dataclasses import dataclass

from contract import ErrorKind, FinishReason
from engines.controllers.driver.output import BranchOutput
from engines.controllers.ipc.messages import AdvanceAnswer, PreState

__all__ = ["Action", "ControllerFailed", "Edit", "Finish", "Fork", "RunSegment", "Suspend",
           "decide"]

RUNAWAY_FACTOR = 4


class ControllerFailed(Exception):
    """Ends the branch with an ErrorEvent of ``kind``."""

    def __init__(self, message: str, kind: ErrorKind, param: str = "controller") -> None:
        super().__init__(message)
        self.kind = kind
        self.param = param


@dataclass(frozen=True)
class Finish:
    """End the branch (its held token goes out as the last)."""

    reason: FinishReason


@dataclass(frozen=True)
class Suspend:
    """Wait for a sibling's variables (or a poll), then ask again."""


@dataclass(frozen=True)
class Fork:
    """Become ``n`` branches (this one and ``n - 1`` copies)."""

    n: int


@dataclass(frozen=True)
class Edit:
    """Withdraw the output's last ``backtrack`` tokens, then append ``forced``."""

    forced: list[int]
    backtrack: int


@dataclass(frozen=True)
class RunSegment:
    """Let the model sample: one engine request (a segment) from the output so far."""


Action = Finish | Suspend | Fork | Edit | RunSegment


def decide(state: AdvanceAnswer, output: BranchOutput, max_tokens: int) -> Action:
    """What a branch with ``output`` so far does next, given the controller's ``state``."""
    if state.stop:  # before the budget: a stop on the last token is a stop
        return Finish("eos")
    # Withdrawn tokens make room again; a controller that keeps withdrawing what it made
    # still ends, at 4x the budget in tokens appended.
    if len(output.out) >= max_tokens or \
            output.sampled + output.forced >= RUNAWAY_FACTOR * max_tokens:
        return Finish("length")
    pre = state.pre or PreState()
    if pre.suspend:
        return Suspend()
    if pre.num_forks > 1:
        if pre.ff_tokens or pre.backtrack:
            raise ControllerFailed("a pre result that forks cannot also force or withdraw "
                                   "tokens on this engine", "validation")
        return Fork(pre.num_forks)
    if pre.withdrawn > len(output.out):
        raise ControllerFailed(f"the controller withdrew {pre.withdrawn} tokens, but only "
                               f"{len(output.out)} were generated", "validation")
    if pre.ff_tokens or pre.backtrack:
        # forced tokens are cut at the budget; the controller hears of what was appended
        room = max_tokens - (len(output.out) - pre.withdrawn)
        return Edit(list(pre.ff_tokens)[:room], pre.withdrawn)
    return RunSegment()

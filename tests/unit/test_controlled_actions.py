"""What a controlled branch does next (engines/controllers/driver/actions.py), one case each."""

import pytest

from engines.controllers.driver.actions import (
    ControllerFailed,
    Edit,
    Finish,
    Fork,
    RunSegment,
    Suspend,
    decide,
)
from engines.controllers.ipc.messages import AdvanceAnswer, PreState


class _Output:
    def __init__(self, out=(), sampled=0, forced=0):
        self.out, self.sampled, self.forced = list(out), sampled, forced


def _decide(pre=None, stop=False, out=(), max_tokens=8, **counts):
    return decide(AdvanceAnswer(stop=stop, pre=pre), _Output(out, **counts), max_tokens)


def test_each_answer_has_one_next_step():
    assert _decide(stop=True, out=[1] * 8) == Finish("eos")  # a stop on the last token
    assert _decide(out=[1] * 8) == Finish("length")
    assert _decide(PreState(suspend=True)) == Suspend()
    assert _decide(PreState(num_forks=3)) == Fork(3)
    assert _decide(PreState(ff_tokens=[5, 6], backtrack=1), out=[1, 2]) == Edit([5, 6], 1)
    assert _decide(PreState()) == RunSegment() == _decide(None)


def test_forced_tokens_are_cut_at_the_budget_after_the_withdrawal():
    assert _decide(PreState(ff_tokens=[5, 6, 7]), out=[1] * 6) == Edit([5, 6], 0)
    assert _decide(PreState(ff_tokens=[5, 6, 7], backtrack=2), out=[1] * 7) == Edit([5, 6, 7], 2)


def test_a_controller_that_keeps_withdrawing_ends_at_four_times_the_budget():
    assert _decide(PreState(ff_tokens=[5]), out=[1], sampled=20, forced=12) == Finish("length")


@pytest.mark.parametrize("pre, out, message", [
    (PreState(num_forks=2, ff_tokens=[5]), [], "cannot also force"),
    (PreState(backtrack=3), [1, 2], "withdrew 3 tokens, but only 2"),
])
def test_what_this_engine_cannot_do_is_the_controllers_error(pre, out, message):
    with pytest.raises(ControllerFailed, match=message) as info:
        _decide(pre, out=out)
    assert info.value.kind == "validation"

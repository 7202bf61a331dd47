"""declctrl (engines/controllers/runtime/declctrl.py) against a stand-in for the engine that respects
its masks and edits: every construct, with the embedded model's real tokenizer (llguidance
needs one). The stand-in "model" wants to write one of ``scripts`` (the first that the text so
far begins): at each step it picks the allowed token that continues it furthest, EOS when it
is done (if allowed), else the first allowed token. Programs are in the JSON shape AICI's ``pyaici.ast`` emits
(``tests/aici_ast.py``)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from engines.controllers.api.base import ControllerContext, ControllerError, Variables
from engines.controllers.runtime.declctrl import SEP, DeclController
from tests import aici_ast as ast


@pytest.fixture(scope="module")
def tok():
    from engines.controllers.runtime.builtin import HFTokenizerInfo
    from engines.kit.embedded import prepare_embedded_model
    return HFTokenizerInfo.from_pretrained(str(prepare_embedded_model(progress=False)))


class _Run:
    def __init__(self, tok, steps, *scripts: str):
        self.tok, self.scripts = tok, [s.encode() for s in scripts]
        self.ctx = ControllerContext(tok, Variables())
        self.ctrl = DeclController(self.ctx, json.dumps({"steps": steps}), [])
        self.out: list[int] = []
        self.backtracks: list[int] = []

    def _allowed(self) -> np.ndarray:
        mask = self.ctrl.mid_process()
        if mask is None:
            return np.ones(self.tok.vocab_size, dtype=bool)
        if mask.dtype == np.bool_:
            return mask
        bits = np.unpackbits(mask.astype("<u4").view(np.uint8), bitorder="little")
        return bits[:self.tok.vocab_size].astype(bool)

    def _sample(self) -> int:
        allowed = self._allowed()
        text = self.tok.decode(self.out)
        rest = next((s[len(text):] for s in self.scripts if s.startswith(text)), b"")
        best, best_len = None, 0
        for t in np.flatnonzero(allowed):
            piece = self.tok.decode([int(t)])
            if piece and rest.startswith(piece) and len(piece) > best_len:
                best, best_len = int(t), len(piece)
        if best is not None:
            return best
        if allowed[self.tok.eos_token_id]:
            return self.tok.eos_token_id
        return int(np.flatnonzero(allowed)[0])

    def go(self, limit: int = 200) -> str:
        while len(self.out) < limit:
            pre = self.ctrl.pre_process()
            assert pre.num_forks <= 1 and not pre.suspend, "use _Forks"
            if self.step(pre):
                break
        return self.text

    def step(self, pre) -> bool:
        """Carry out one pre result (not a fork or a suspend); True once stopped."""
        if pre.num_forks == 0:
            return True
        if pre.backtrack or pre.ff_tokens:
            if pre.backtrack:
                self.backtracks.append(pre.backtrack)
                del self.out[len(self.out) - pre.backtrack:]
            self.out += pre.ff_tokens
            return self.ctrl.post_process(list(pre.ff_tokens), pre.backtrack)
        token = self._sample()
        self.out.append(token)
        return self.ctrl.post_process([token], 0)

    def fork(self) -> _Run:
        child = object.__new__(_Run)
        child.tok, child.scripts = self.tok, self.scripts
        child.ctx = self.ctx.forked()
        child.ctrl = self.ctrl.fork(child.ctx)
        child.out, child.backtracks = list(self.out), []
        return child



    @property
    def text(self) -> str:
        return self.tok.decode(self.out).decode()

    def var(self, name: str) -> str:
        return (self.ctx.get_var(name) or b"").decode()


class _Forks:
    """The stand-in engine for forks: every live branch takes a step in turn (as the seed's
    engine runs every non-suspended sequence each step); a fork's copies are told their branch
    index (the original is branch 0); it ends when every branch stopped, or in a deadlock
    when every live one is suspended."""

    def __init__(self, tok, steps, *scripts: str):
        self.runs = [_Run(tok, steps, *scripts)]
        self.deadlock = False

    def go(self, limit: int = 200) -> list[str]:
        done: set[int] = set()
        for _ in range(limit):
            live = [i for i in range(len(self.runs)) if i not in done]
            if not live:
                break
            moved = False
            for i in live:
                run = self.runs[i]
                pre = run.ctrl.pre_process()
                if pre.suspend:
                    continue
                moved = True
                if pre.num_forks > 1:
                    children = [run.fork() for _ in range(pre.num_forks - 1)]
                    for index, branch in enumerate([run, *children]):
                        branch.ctrl.forked(index)
                    self.runs += children
                elif run.step(pre):
                    done.add(i)
            if not moved:
                self.deadlock = True
                break
        return [run.text for run in self.runs]

    @property
    def ctx(self) -> ControllerContext:
        return self.runs[0].ctx


def test_fixed_then_gen_with_limits(tok):
    run = _Run(tok, [ast.fixed("Hello"), ast.gen(max_tokens=3)], "Hello, I am here")
    assert run.go() == "Hello, I am"  # 3 tokens, then the program ends
    assert run.ctrl.step.kind == "Stop"


def test_gen_num_masks_digits_and_forces_the_fixed_text_between(tok):
    steps = [ast.fixed("I am about "), ast.gen(max_tokens=2, rx=r"\d+"),
             ast.fixed(" years and "), ast.gen(max_tokens=2, rx=r"\d+"), ast.fixed(" months.")]
    # The "model" would rather write words: the mask makes it write digits.
    run = _Run(tok, steps, "I am about ten years")
    text = run.go()
    import re
    assert re.fullmatch(r"I am about \d{1,2} years and \d{1,2} months\.", text), text


def test_a_step_that_may_end_ends_where_the_model_starts_the_next_fixed_text(tok):
    steps = [ast.fixed("Hello"), ast.gen(rx=", ", max_tokens=10), ast.fixed("3 + 8 ="),
             ast.gen(rx=r" \d+", set_var="sum"), ast.fixed("!")]
    # ", " ends by itself (nothing can follow); " \d+" may go on, and its mask also holds the
    # first token of "!", which the model picks: the Gen ends there, as in AICI.
    run = _Run(tok, steps, "Hello, 3 + 8 = 11!")
    assert run.go() == "Hello, 3 + 8 = 11!"
    assert run.backtracks == [] and tok.eos_token_id not in run.out
    assert run.var("sum") == " 11"


def test_a_step_that_may_end_before_a_gen_ends_on_eos_which_is_withdrawn(tok):
    steps = [ast.fixed("n ="), ast.gen(rx=r" \d+", set_var="n"),
             ast.gen(rx="[a-z ]+", max_tokens=3)]
    run = _Run(tok, steps, "n = 7 abc")
    run.go()
    assert run.backtracks == [1]  # the EOS that ended " \d+"
    assert tok.eos_token_id not in run.out[:-1]
    assert tok.decode([t for t in run.out if t != tok.eos_token_id]).decode() == "n = 7 abc"
    assert run.var("n") == " 7"


def test_the_eos_that_ends_the_last_step_stays(tok):
    run = _Run(tok, [ast.fixed("n ="), ast.gen(rx=r" \d+")], "n = 7")
    run.go()
    assert run.out[-1] == tok.eos_token_id and run.backtracks == []
    assert tok.decode(run.out[:-1]).decode() == "n = 7"


def test_stop_at_keeps_the_stop_string_in_the_text_and_the_variable(tok):
    steps = [ast.fixed("List:"), ast.gen(max_tokens=20, stop_at="DONE", set_var="x"),
             ast.fixed("!")]
    run = _Run(tok, steps, "List: a b DONE and more")
    assert run.go() == "List: a b DONE!"
    assert run.var("x") == " a b DONE"
    writes = [e["WriteVar"] for e in run.ctx.journal()[1]]
    assert writes == [{"name": "x", "value": b" a b DONE".hex(), "op": "Set",
                       "when_version_is": None}]


def test_following_a_label_replaces_that_step_and_what_came_after(tok):
    steps = [ast.fixed("Remember:\nFoo"), ast.label("l", ast.fixed("\nBar")),
             ast.fixed("\nRepeat:\n"), ast.gen(max_tokens=10, stop_at="DONE", set_var="x"),
             ast.fixed("\nQux\nRepeat:\n", following="l"),
             ast.gen(max_tokens=10, stop_at="DONE", set_var="y")]
    run = _Run(tok, steps, "Remember:\nFoo\nBar\nRepeat:\nFoo Bar DONE",
               "Remember:\nFoo\nQux\nRepeat:\nFoo Qux DONE")
    text = run.go()
    assert text == "Remember:\nFoo\nQux\nRepeat:\nFoo Qux DONE"
    assert (run.var("x"), run.var("y")) == ("Foo Bar DONE", "Foo Qux DONE")
    assert run.backtracks == [len(tok.encode("\nBar")) + len(tok.encode("\nRepeat:\n"))
                              + len(tok.encode("Foo Bar DONE"))]


def test_choose_picks_one_option(tok):
    steps = [ast.fixed("valid:"), ast.choose(["true", "false"]), ast.fixed(".")]
    assert _Run(tok, steps, "valid:false, surely").go() == "valid:false."


def test_expressions_and_statements(tok):
    steps = [ast.fixed("n="),
             ast.gen(rx=r"\d+", max_tokens=2, stmts=[
                 ast.stmt_set("list", ast.e_list(ast.e_str("a"), ast.e_current())),
                 ast.stmt_set("eq", ast.e_ifeq(ast.e_current(), ast.e_str("42"),
                                               ast.e_str("yes"), ast.e_str("no"))),
                 ast.stmt_set("ext", ast.e_extract_all(r"(\d)", ast.e_current(), "<$1>")),
                 ast.stmt_set("one", ast.e_extract_one(r"(\d)(\d)", ast.e_current(), "$2$1$3")),
             ]),
             ast.fixed(" then {{eq}} {{missing}}.", expand_vars=True)]
    run = _Run(tok, steps, "n=42")
    assert run.go() == "n=42 then yes ."
    assert run.ctx.get_var("list") == b"a" + SEP + b"42"
    assert run.ctx.get_var("ext") == b"<4>" + SEP + b"<2>"
    assert run.var("one") == "24"


@pytest.mark.parametrize(("steps", "needle"), [
    ([ast.fork([ast.fixed("a")])], "two or more non-empty"),
    ([ast.fork([ast.fixed("a")], [])], "two or more non-empty"),
    ([ast.wait_vars()], "Wait.vars"),
    ([ast.fork([ast.gen(rx="(")], [ast.fixed("b")])], "step 0.branch 0.step 0"),
    ([ast.gen(yacc="x: 'a';")], "yacc"),
    ([ast.gen(rx="a", inner={"<city>": ast.e_str("a")})], "inner cannot be combined"),
    ([{"Gen": {"inner": [{"after": "", "options": {"String": {"str": "a"}}}]}}], "Gen.inner"),
    ([{"Gen": {"max_tokens": 0}}], "max_tokens"),
    ([{"Nope": {}}], "a step is one of"),
    ([ast.gen(rx="(")], "step 0"),
])
def test_programs_this_engine_cannot_run_are_refused_clearly(tok, steps, needle):
    with pytest.raises(ControllerError, match=needle):
        _Run(tok, steps).go()


@pytest.mark.parametrize("arg", ["not json", "[]", '{"steps": []}', '{"steps": [1]}'])
def test_malformed_programs_are_refused(tok, arg):
    with pytest.raises(ControllerError, match="declctrl"):
        DeclController(ControllerContext(tok, Variables()), arg, [])


def test_following_an_unknown_label_is_an_error(tok):
    with pytest.raises(ControllerError, match="no step labelled 'x'"):
        _Run(tok, [ast.fixed("a"), ast.fixed("b", following="x")]).go()


def test_an_empty_fixed_text_is_skipped_without_taking_a_sampled_token(tok):
    steps = [ast.fixed("a="), ast.fixed("{{unset}}", expand_vars=True),
             ast.gen(rx=r"\d", max_tokens=1, set_var="d")]
    run = _Run(tok, steps, "a=5")
    assert run.go() == "a=5" and run.var("d") == "5"


def test_a_regex_and_a_stop_string_end_where_the_regex_can_take_nothing_more(tok):
    steps = [ast.fixed("n="), ast.gen(rx=r"\d\d", stop_at="\n", set_var="n"), ast.fixed(".")]
    run = _Run(tok, steps, "n=42 and more")
    assert run.go() == "n=42." and run.var("n") == "42"


def test_values_are_bounded(tok):
    double = ast.stmt_set("x", ast.e_concat(ast.e_var("x"), ast.e_var("x"), ast.e_str("ab")))
    steps = [ast.fixed("a", ), *[{"Fixed": {"text": {"String": {"str": ""}}, "stmts": [double]}}
                                 for _ in range(25)]]
    with pytest.raises(ControllerError, match="a value over"):
        _Run(tok, steps).go()


def test_extract_runs_in_linear_time_and_reads_named_groups(tok):
    import time

    steps = [ast.fixed("x"), ast.gen(rx="y", max_tokens=1, stmts=[
        ast.stmt_set("slow", ast.e_extract_one(r"(a+)+$", ast.e_str("a" * 40 + "b"))),
        ast.stmt_set("named", ast.e_extract_one(r"(?P<d>\d)", ast.e_str("ab7"), "<${d}>"))])]
    started = time.monotonic()
    run = _Run(tok, steps, "xy")
    run.go()
    assert time.monotonic() - started < 5  # Python's re would take hours on that pattern
    assert run.var("slow") == "" and run.var("named") == "<7>"


# --- Fork and Wait ----------------------------------------------------------------------------

def test_fork_runs_each_branch_then_the_steps_after_it_in_every_branch(tok):
    """AICI's fork_1, plus a step after the Fork."""
    steps = [ast.fixed("The word 'hello' in"),
             ast.fork([ast.fixed(" French is"), ast.gen(max_tokens=5, set_var="fr")],
                      [ast.fixed(" Spanish is"), ast.gen(max_tokens=5, set_var="es")]),
             ast.fixed(".")]
    forks = _Forks(tok, steps, "The word 'hello' in French is bonjour",
                   "The word 'hello' in Spanish is hola")
    texts = forks.go()
    assert texts == ["The word 'hello' in French is bonjour.",
                     "The word 'hello' in Spanish is hola."], texts
    assert not forks.deadlock
    # the forks share their variables
    assert forks.ctx.get_var("fr") == b" bonjour" and forks.ctx.get_var("es") == b" hola"


def test_wait_suspends_until_a_sibling_sets_the_variable(tok):
    """AICI's wait_1: branch 0 waits for what branch 1 generates, then uses it."""
    steps = [ast.fixed("The word 'hello' in"),
             ast.fork([ast.fixed("\n"), ast.wait_vars("french"),
                       ast.fixed("French:{{french}}", expand_vars=True)],
                      [ast.fixed(" French is"), ast.gen(rx=r" '[^']*'", set_var="french")])]
    forks = _Forks(tok, steps, "The word 'hello' in French is 'bonjour'")
    texts = forks.go()
    assert texts == ["The word 'hello' in\nFrench: 'bonjour'",
                     "The word 'hello' in French is 'bonjour'"], texts
    assert not forks.deadlock


def test_a_wait_nobody_can_satisfy_is_a_deadlock(tok):
    forks = _Forks(tok, [ast.fixed("a"), ast.fork([ast.wait_vars("x")], [ast.wait_vars("y")])])
    forks.go()
    assert forks.deadlock


def test_a_gen_before_a_fork_moves_on_to_it_as_soon_as_it_may_end(tok):
    """AICI's greedy rule: a Gen without a stop string that may end forks right away."""
    steps = [ast.gen(max_tokens=5), ast.fork([ast.fixed(" A")], [ast.fixed(" B")])]
    forks = _Forks(tok, steps, "Hello world")
    texts = forks.go()
    assert texts == ["Hello A", "Hello B"], texts


def test_forks_have_their_own_regex_state(tok):
    """A regex step after the Fork runs in each branch on its own matcher (llguidance's are
    copied, not shared)."""
    steps = [ast.fixed("n="), ast.fork([ast.fixed("1")], [ast.fixed("2")]),
             ast.gen(rx=r"[0-9]{2}", set_var="n")]
    forks = _Forks(tok, steps, "n=123", "n=245")
    assert forks.go() == ["n=123", "n=245"]


def test_forked_outside_a_fork_is_an_error(tok):
    run = _Run(tok, [ast.fixed("a")])
    with pytest.raises(ControllerError, match="outside a Fork"):
        run.ctrl.forked(1)


# --- Gen.inner ------------------------------------------------------------------------------

CITIES = ast.e_list(ast.e_str("Paris</city>"), ast.e_str("London</city>"))


def test_inner_takes_the_model_s_option_after_its_marker_then_free_text_again(tok):
    run = _Run(tok, [ast.fixed("Cities:"), ast.gen(max_tokens=40, inner={"<city>": CITIES})],
               "Cities: <city>London</city> and more")
    # (the EOS that ends the last step stays, as AICI's)
    assert run.go() == "Cities: <city>London</city> and more<|im_end|>"


def test_inner_keeps_the_text_after_its_marker_to_the_options(tok):
    """The model wants Rome after the second marker: it gets one of the options instead (the
    rest of the option forced once only it is left)."""
    run = _Run(tok, [ast.fixed("Cities:"), ast.gen(max_tokens=40, inner={"<city>": CITIES})],
               "Cities: <city>Paris</city> and <city>Rome</city>")
    text = run.go().removesuffix("<|im_end|>")
    assert re.fullmatch(r"Cities: <city>Paris</city> and <city>(Paris|London)</city>", text), text
    assert "inner: after '<city>', 2 options" in "".join(run.ctx.drain()[0])

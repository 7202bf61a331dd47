"""AICI's own declctrl test-suite (microsoft/aici ``py/tests/declctrl_test.py``), adapted to
the embedded model: the same programs (built as ``pyaici.ast`` builds them: ``tests.aici_ast``),
sent the same way (``tests.aici_client``, which behaves as ``pyaici.rest``: controller
``declctrl``, greedy, 200 tokens), through Ray Serve to the vLLM replica. AICI compares
Orca-2-13B's exact words; these check the structure the program imposes instead: regexes
matched, forced text in place, backtracked text gone, variables (``storage``) equal to the
text they were taken from. fork_1's forks are also checked against vLLM's own greedy pass over
each fork's prefix (``reference_greedy``, no gateway code); wait_1's waiting fork writes what its
siblings generated. inner_1 takes its list of cities from a fixed list (the 135M model does
not write AICI's list on request) and checks that every ``<city>`` the model then writes is
followed by one of them; ``yacc`` is refused by this engine with a clear error.
"""

from __future__ import annotations

import json
import re

import pytest

from tests import aici_ast as ast
from tests.aici_client import AiciClient

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def aici(gateway_url) -> AiciClient:
    return AiciClient(f"{gateway_url}/v1/")


def _query(aici: AiciClient, prompt: str, steps: list[dict]) -> dict:
    """AICI's greedy_query: the prompt as a first Fixed step, temperature 0, 200 tokens."""
    if prompt:
        steps = [ast.fixed(prompt), *steps]
    return aici.run(controller="declctrl", controller_arg={"steps": steps}, temperature=0.0,
                    max_tokens=200)


def _ok(result: dict, ends: tuple[str, ...] = ("aici-stop",)) -> str:
    text = result["text"][0]
    assert result["error"] is None, result["error"]
    assert result["response"][-1]["forks"][0]["finish_reason"] in ends, text
    return text


def _final(text: str) -> str:
    """The text as it stands after the last backtrack: AICI's stream marks a backtrack with
    " ↩ " and retracts nothing, so pyaici's text holds the withdrawn parts too."""
    return text.rsplit(BACKTRACK, 1)[-1]


BACKTRACK = " \u21a9 "


def test_hello(aici):
    text = _ok(_query(aici, "Hello", [ast.gen(max_tokens=3)]))
    assert text.startswith("Hello") and len(text) > len("Hello"), text


def test_gen_num(aici):
    text = _ok(_query(aici, "", [
        ast.fixed("I am about "), ast.gen(max_tokens=2, rx=r"\d+"),
        ast.fixed(" years and "), ast.gen(max_tokens=2, rx=r"\d+"), ast.fixed(" months.")]))
    assert re.fullmatch(r"I am about \d+ years and \d+ months\.", text), text


def test_logs_and_micros_stream_with_the_run_not_only_at_its_end(aici):
    # AICI sends what the controller logged with each event; the first Gen's "finish" line is
    # known once its segment ends, long before the program's end
    result = _query(aici, "", [
        ast.fixed("I am about "), ast.gen(max_tokens=2, rx=r"\d+"),
        ast.fixed(" years and "), ast.gen(max_tokens=2, rx=r"\d+"), ast.fixed(" months.")])
    _ok(result)
    entries = [fork for obj in result["response"] for fork in obj.get("forks", ())]
    logged = [i for i, fork in enumerate(entries) if fork["logs"]]
    assert logged and logged[0] < len(entries) - 1, entries
    assert "finish:" in entries[logged[0]]["logs"]
    assert result["logs"][0].count("finish:") >= 2  # every Gen's, once each
    assert sum(fork["micros"] for fork in entries) > 0


JSON_TEMPLATE = {"name": "", "valid": True, "description": "",
                 "type": "foo|bar|baz|something|else",
                 "address": {"street": "", "city": "", "state": "[A-Z][A-Z]"},
                 "age": 1, "fraction": 1.5}


def _wrap(text: str) -> str:
    """The model's chat format around a user message (AICI wraps with Orca-2's)."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_json(aici):
    prompt = _wrap("Write about J. Random Hacker from Seattle in JSON.")
    steps = ast.json_to_steps(JSON_TEMPLATE)
    # The 135M model can loop inside a free string ("A.A.A...") where Orca-2 closed it; with
    # no spaces AICI's max_words never ends it, so free strings also get a token bound here.
    for step in steps:
        if "Gen" in step and step["Gen"]["max_tokens"] is None:
            step["Gen"]["max_tokens"] = 24
    text = _ok(_query(aici, prompt, steps))
    value = json.loads(text[text.index("{"):])  # the chat markers are special: not in text
    assert list(value) == list(JSON_TEMPLATE)
    assert isinstance(value["valid"], bool) and value["type"] in "foo|bar|baz|something|else"
    assert re.fullmatch("[A-Z][A-Z]", value["address"]["state"])
    assert isinstance(value["age"], int) and isinstance(value["fraction"], int | float)
    assert all(isinstance(value[k], str) and value[k] for k in ("name", "description"))


@pytest.mark.parametrize(("steps", "pattern"), [
    ([{"Gen": {"rx": ", ", "max_tokens": 10}}, {"Fixed": {"text": {"String": {"str": "3 + 8 ="}}}},
      {"Gen": {"max_tokens": 5}}], r"Hello, 3 \+ 8 =.+"),
    ([ast.gen(rx=", "), ast.fixed("7 + 8 ="), ast.gen(rx=r" \d+")], r"Hello, 7 \+ 8 = \d+"),
    ([ast.gen(rx=", "), ast.fixed("7 + 8"), ast.gen(rx=r" = \d+")], r"Hello, 7 \+ 8 = \d+"),
], ids=["ff_0", "ff_1", "ff_2"])
def test_ff(aici, steps, pattern):
    result = _query(aici, "Hello", steps)
    # The last Gen ends where the model chooses EOS over another digit, or at the budget.
    text = _ok(result, ("aici-stop", "length"))
    assert re.fullmatch(pattern, text, re.DOTALL), text
    assert result["usage"]["ff_tokens"] > 1  # the forced text, beside the 1-token start


@pytest.mark.parametrize("french", [" in French is translated as", " French", " in French is",
                                    " in Paris is"])
def test_backtrack_1(aici, french):
    result = _query(aici, "", [
        ast.fixed("The word 'hello'"),
        ast.label("lang", ast.fixed(french)),
        ast.gen(rx=r" '[^'\.]*'", max_tokens=15, set_var="french"),
        ast.fixed(" or", following="lang"),
        ast.gen(rx=r" '[^'\.]*'", max_tokens=15, set_var="blah"),
        ast.fixed("\nResults:{{french}}{{blah}}", expand_vars=True)])
    text = _ok(result)
    french_value, blah = result["storage"]["french"], result["storage"]["blah"]
    # " or" replaced the labelled step and the answer after it (from "lang" on)
    assert text.startswith(f"The word 'hello'{french}{french_value}{BACKTRACK}"), text
    assert _final(text) == f" or{blah}\nResults:{french_value}{blah}", text
    assert french_value.startswith(" '") and blah.startswith(" '")


def test_backtrack_2(aici):
    result = _query(aici, "", [
        ast.fixed("Please remember the following items:\nFoo\nZzzzz"),
        ast.label("l", ast.fixed("\nBar\nBaz")),
        ast.fixed("\nPlease repeat the list, say DONE when done:\n"),
        ast.gen(max_tokens=20, stop_at="DONE", set_var="x"),
        ast.fixed("\nQux\nMux\nPlease repeat the list, say DONE when done:\n", following="l"),
        ast.gen(max_tokens=20, stop_at="DONE", set_var="y")])
    text = _ok(result)
    x, y = result["storage"]["x"], result["storage"]["y"]
    first = "Please remember the following items:\nFoo\nZzzzz\nBar\nBaz\n" \
            "Please repeat the list, say DONE when done:\n"
    # the labelled "\nBar\nBaz" and everything after it were withdrawn, then replaced
    assert text == first + x + BACKTRACK + "\nQux\nMux\nPlease repeat the list, say DONE " \
                                           "when done:\n" + y, text
    assert x and y


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from engines.kit.embedded import prepare_embedded_model
    return AutoTokenizer.from_pretrained(str(prepare_embedded_model(progress=False)))


def _greedy_or_near_tie(openai_client, engine_handle, hf_tokenizer, ids: list[int], text: str,
                        max_tokens: int, tolerance: float) -> None:
    """``text`` is vLLM's own greedy continuation of ``ids`` (``reference_greedy``), or leaves
    it only where the two best tokens are within ``tolerance``: forks run in one batch, the
    reference alone, and bf16 CPU kernels are not batch-invariant (the same near-tie rule as
    tests/e2e/test_openai_e2e.py's concurrent streams)."""
    from tests.e2e.conftest import MODEL

    reference = engine_handle.reference_greedy.remote(ids, max_tokens).result()
    if text == reference.text:
        return
    # the longest run of reference tokens whose text the fork's text starts with
    k = 0
    while k < len(reference.token_ids) and text.startswith(
            hf_tokenizer.decode(reference.token_ids[:k + 1])):
        k += 1
    assert k < len(reference.token_ids), (text, reference.text)
    kept = reference.token_ids[:k]
    top = openai_client.completions.create(model=MODEL, prompt=ids + kept, max_tokens=1,
                                           temperature=0, logprobs=5).choices[0].logprobs
    alternatives = top.top_logprobs[0]
    rest = text[len(hf_tokenizer.decode(kept)):]
    taken = max((t for t in alternatives if t and rest.startswith(t)), key=len, default=None)
    assert taken is not None, (text, reference.text, alternatives)
    assert max(alternatives.values()) - alternatives[taken] <= tolerance, (
        text, reference.text, alternatives)


def test_fork_1(aici, engine_handle, hf_tokenizer, openai_client, logprob_tolerance):
    prefix, langs = "The word 'hello' in", [" French is", " Spanish is"]
    result = _query(aici, "", [
        ast.fixed(prefix),
        ast.fork(*([ast.fixed(lang), ast.gen(max_tokens=5)] for lang in langs))])
    assert result["error"] is None, result["error"]
    texts = result["text"]
    assert len(texts) == 2, texts
    ends = {f["index"]: f["finish_reason"] for o in result["response"] for f in o.get("forks", ())
            if "finish_reason" in f}
    assert ends == {0: "aici-stop", 1: "aici-stop"}, ends
    # Each fork is the common prefix, its own Fixed, then what vLLM's own greedy pass gives
    # after that prefix (from the empty prompt's start token; each Fixed tokenized alone).
    encode = lambda text: hf_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for text, lang in zip(texts, langs, strict=True):
        ids = [hf_tokenizer.eos_token_id, *encode(prefix), *encode(lang)]
        assert text.startswith(prefix + lang), text
        _greedy_or_near_tie(openai_client, engine_handle, hf_tokenizer, ids,
                            text[len(prefix + lang):], 5, logprob_tolerance)


def test_wait_1(aici):
    result = _query(aici, "", [
        ast.fixed("The word 'hello' in"),
        ast.fork(
            [ast.fixed("\n"), ast.wait_vars("french", "spanish"),
             ast.fixed("french:{{french}}\nspanish:{{spanish}}\n", expand_vars=True)],
            [ast.fixed(" Spanish is"), ast.gen(rx=r" '[^']*'", max_tokens=15,
                                               set_var="spanish")],
            [ast.fixed(" French is"), ast.gen(rx=r" '[^']*'", max_tokens=15,
                                              set_var="french")])])
    assert result["error"] is None, result["error"]
    texts, storage = result["text"], result["storage"]
    assert len(texts) == 3, texts
    french, spanish = storage["french"], storage["spanish"]
    # the waiting fork wrote what its siblings generated, once both had
    assert texts[0] == f"The word 'hello' in\nfrench:{french}\nspanish:{spanish}\n", texts
    assert texts[1:] == [f"The word 'hello' in Spanish is{spanish}",
                         f"The word 'hello' in French is{french}"], texts
    assert re.fullmatch(r" '[^']*'?", french) and re.fullmatch(r" '[^']*'?", spanish)


def test_forks_that_all_wait_end_in_a_deadlock(aici):
    result = _query(aici, "", [ast.fixed("Hi"),
                               ast.fork([ast.wait_vars("x")], [ast.wait_vars("y")])])
    assert result["error"] and "deadlock" in result["error"]
    last = result["response"][-1]["forks"]
    assert [(f["index"], f["finish_reason"]) for f in last] == [(0, "deadlock"),
                                                                (1, "deadlock")]
    assert result["text"] == ["Hi", "Hi"]
    # a deadlock before any output is still a stream (not an HTTP error), as in AICI
    alone = _query(aici, "", [ast.wait_vars("x")])
    assert [f["finish_reason"] for f in alone["response"][-1]["forks"]] == ["deadlock"]


def test_inner_1(aici):
    listing = "<city>Warsaw</city>\n<city>Krakow</city>\n<city>Gdansk</city>\n"
    result = _query(aici, "", [
        ast.fixed(_wrap("List cities in Poland. Use <city>City Name</city> syntax.")),
        {"Fixed": {"text": ast.e_str(listing), "stmts": [ast.stmt_set(
            "cities", ast.e_extract_all(r"<city>([^<]*</city>)", ast.e_current()))]}},
        ast.gen(max_tokens=30, inner={"<city>": ast.e_var("cities")})])
    text = _ok(result, ("aici-stop", "length"))
    cities = result["storage"]["cities"].split("\uff0c")
    assert cities == ["Warsaw</city>", "Krakow</city>", "Gdansk</city>"], cities
    generated = text.split(listing, 1)[1]
    after = generated.split("<city>")[1:]
    assert after, f"the model wrote no <city> to constrain: {generated!r}"
    for i, rest in enumerate(after):  # each is one of the options (the last may be cut short)
        assert any(rest.startswith(c) or (i == len(after) - 1 and c.startswith(rest))
                   for c in cities), generated


@pytest.mark.parametrize(("steps", "needle"), [
    ([ast.gen(max_tokens=20, yacc="x: 'a';")], "yacc"),
], ids=["yacc"])
def test_what_this_engine_refuses_fails_the_run_with_a_clear_error(aici, steps, needle):
    result = _query(aici, "", steps)
    assert result["error"] and needle in result["error"], result["error"]
    assert result["response"][-1]["forks"][0]["finish_reason"] == "fail"


def test_forks_are_extra_choices_of_a_whole_openai_response_and_refused_in_a_stream(
        openai_client, engine_handle, hf_tokenizer, logprob_tolerance):
    """The same fork through the openai SDK: a whole response applies it as an extra choice
    (each equal to vLLM's own greedy pass over its prefix); a stream, which cannot open a
    choice it was not asked for, ends with an error saying so."""
    import openai

    from tests.e2e.conftest import MODEL

    prompt, langs = "The word 'hello' in", [" French is", " Spanish is"]
    program = json.dumps({"steps": [ast.fork(*([ast.fixed(lang), ast.gen(max_tokens=4)]
                                               for lang in langs))]})
    extra = {"controller": "declctrl", "controller_arg": program}
    whole = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                             temperature=0, extra_body=extra)
    assert [c.index for c in whole.choices] == [0, 1]
    prompt_ids = engine_handle.reference_greedy.remote(prompt, 1).result().prompt_token_ids
    for choice, lang in zip(whole.choices, langs, strict=True):
        ids = prompt_ids + hf_tokenizer.encode(lang, add_special_tokens=False)
        assert choice.text.startswith(lang), choice.text
        _greedy_or_near_tie(openai_client, engine_handle, hf_tokenizer, ids,
                            choice.text[len(lang):], 4, logprob_tolerance)
        assert choice.finish_reason == "stop"
    with pytest.raises(openai.APIError, match="forked into a new choice"):
        for _ in openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                                  temperature=0, stream=True,
                                                  extra_body=extra):
            pass

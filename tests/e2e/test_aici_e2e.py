"""AICI's REST API end to end: a client that behaves as AICI's own ``pyaici.rest``
(``tests.aici_client``) → Ray Serve → the vLLM replica with its controller runtime.

Oracles: vLLM's own greedy output (``reference_greedy``, no gateway code) for ``none``; the
grammar itself (``re.fullmatch``) for ``llguidance``; the engine's own tag list for tags.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.aici_client import AiciClient

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
TOKENS = 10
REGEX = r"Answer: [0-9]{2}\."


def _guidance_regex(pattern: str) -> dict:
    return {"grammar": {"grammars": [{"lark_grammar": f"start: /{pattern}/"}]}}


@pytest.fixture(scope="module")
def aici(gateway_url) -> AiciClient:
    return AiciClient(f"{gateway_url}/v1/")


def test_none_equals_vllms_own_greedy_output(aici, engine_handle):
    reference = engine_handle.reference_greedy.remote(PROMPT, TOKENS).result()
    result = aici.run(controller="none", controller_arg=PROMPT, max_tokens=TOKENS,
                      temperature=0.0)
    assert result["error"] is None
    assert result["text"] == [reference.text]
    objects = result["response"]
    assert objects[0]["object"] == "initial-run" and objects[0]["id"].startswith("run-")
    assert objects[-1]["forks"][0]["finish_reason"] == "length"
    prompt_tokens = len(reference.prompt_token_ids)
    assert result["usage"] == {"sampled_tokens": TOKENS, "ff_tokens": prompt_tokens,
                               "cost": 2 * TOKENS + prompt_tokens}


def test_an_llguidance_run_from_pyaici_matches_its_regex_and_stops(aici):
    result = aici.run(controller="llguidance", controller_arg=_guidance_regex(REGEX),
                      max_tokens=20)
    assert result["error"] is None, result["error"]
    text = result["text"][0]
    assert re.fullmatch(REGEX, text), text
    assert result["response"][-1]["forks"][0]["finish_reason"] == "aici-stop"
    usage = result["usage"]
    # "Answer: " is forced (fast-forward, counted in ff_tokens beside the 1-token prompt);
    # the digits are sampled inside the mask.
    assert usage["ff_tokens"] > 1 and usage["sampled_tokens"] >= 2
    assert usage["cost"] == 2 * usage["sampled_tokens"] + usage["ff_tokens"]


def test_controller_failures_are_in_the_stream(aici):
    for controller, arg, needle in (
            ("llguidance", {"grammar": {"grammars": [{"lark_grammar": "start: /[/"}]}},
             "llguidance"),
            ("no-such-controller", "", "unknown controller")):
        result = aici.run(controller=controller, controller_arg=arg, max_tokens=4)
        assert result["error"] and needle in result["error"], result["error"]
        assert result["response"][0]["object"] == "initial-run"
        assert result["response"][-1]["forks"][0]["finish_reason"] == "fail"


def test_tags_are_the_engines_and_a_new_tag_runs_its_controller(aici):
    tags = {t["tag"]: t for t in aici.list_tags()}
    assert {"llguidance", "none"} <= set(tags)
    module = tags["llguidance"]["module_id"]
    assert re.fullmatch(r"[0-9a-f]{64}", module)
    tag = f"grammar-{int(time.time() * 1000)}"
    assert [t["tag"] for t in aici.tag_module(module, [tag])] == [tag]
    assert aici.list_tags()[0]["tag"] == tag  # newest first
    result = aici.run(controller=tag, controller_arg=_guidance_regex(REGEX), max_tokens=20)
    assert re.fullmatch(REGEX, result["text"][0]), result
    by_id = aici.run(controller=module, controller_arg=_guidance_regex(REGEX), max_tokens=20)
    assert by_id["text"] == result["text"]


def test_refusals_reach_pyaici_as_api_errors(aici):
    with pytest.raises(RuntimeError, match="400 Bad Request: APIError: uploading Wasm"):
        aici.upload_module(b"\0asm\1\0\0\0")
    with pytest.raises(RuntimeError, match=r"400 Bad Request: APIError: .*context"):
        aici.run(controller="none", controller_arg="x", max_tokens=10**6)
    with pytest.raises(RuntimeError, match=r"400 Bad Request: APIError: .*not downloaded"):
        aici.run(controller="gh:microsoft/aici/declctrl")


def test_a_client_that_goes_away_aborts_the_run(gateway_url):
    with httpx.Client(base_url=gateway_url, timeout=60) as http:
        with http.stream("POST", "/v1/run", json={"controller": "none", "controller_arg": PROMPT,
                                                   "max_tokens": 2000}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith('data: {"id":"run-')
        deadline = time.monotonic() + 30
        while http.get("/gateway/engines").json()[next(iter(http.get("/").json()["models"]))][
                "active"]:
            assert time.monotonic() < deadline, "the engine request was not aborted"
            time.sleep(0.2)

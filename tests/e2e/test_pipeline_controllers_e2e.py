"""Controllers on the layer-split model give what they give on vLLM (docs/protocols/pipeline.md,
"Controllers"): an llguidance grammar through OpenAI's ``response_format``, TGI's ``grammar``,
and declctrl programs through AICI's ``/v1/run`` (forced text and a backtrack among them), each
sent to the session's pipeline application and to its vLLM model, greedy.

Oracle: vLLM's own output for the same request. The two engines compute in their own kernels and
maybe dtypes (the pipeline in float32, vLLM in the checkpoint's bfloat16 where the CPU has it), so
where the tokens part, the pipeline's own distribution there must give vLLM's token a logprob
within the looser dtype's tolerance of its own choice (a near-tie), as in the other e2e suites;
declctrl's counting programs have no near-ties to part at and are compared exactly.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests import aici_ast as ast
from tests.aici_client import AiciClient
from tests.e2e.conftest import MODEL, assert_greedy_or_near_tie
from tests.serve_session import LOGPROB_TOLERANCE, PIPELINE_MODEL

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["capital", "country"],
          "properties": {"capital": {"type": "string", "enum": ["Paris", "Rome", "Madrid"]},
                         "country": {"type": "string", "maxLength": 12}}}


@pytest.fixture(scope="module")
def tolerance(engine_handle, pipeline_handle) -> float:
    dtypes = {h.model_info.remote().result().dtype for h in (engine_handle, pipeline_handle)}
    return max(LOGPROB_TOLERANCE[d] for d in dtypes)


def _chat(base_url: str, model: str) -> tuple[str, list[str], list[dict[str, float]]]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model=model, temperature=0, max_tokens=40, logprobs=True, top_logprobs=5,
        messages=[{"role": "user", "content": "Which city is the capital of France? Answer "
                                              "in JSON with the capital and its country."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "capital", "schema": SCHEMA, "strict": True}})
    choice = out.choices[0]
    tokens = [t.token for t in choice.logprobs.content]
    tops = [{alt.token: alt.logprob for alt in t.top_logprobs} for t in choice.logprobs.content]
    return choice.message.content, tokens, tops


def test_response_format_json_schema_writes_what_vllm_writes(pipeline_url, gateway_url,
                                                             tolerance):
    text, tokens, tops = _chat(pipeline_url, PIPELINE_MODEL)
    want, want_tokens, _ = _chat(gateway_url, MODEL)
    jsonschema.validate(json.loads(text), SCHEMA)
    jsonschema.validate(json.loads(want), SCHEMA)
    assert_greedy_or_near_tie(tokens, tops, want_tokens, tolerance)


def _tgi(base_url: str) -> tuple[str, list[str], list[dict[str, float]]]:
    response = httpx.post(f"{base_url}/generate", timeout=120, json={
        "inputs": "The year the Eiffel Tower was finished:", "parameters": {
            "max_new_tokens": 8, "details": True, "top_n_tokens": 5,
            "grammar": {"type": "regex", "value": " [0-9]{4}\\."}}})
    assert response.status_code == 200, response.text
    body = response.json()
    tokens = [t["text"] for t in body["details"]["tokens"]]
    tops = [{alt["text"]: alt["logprob"] for alt in alts} for alts in body["details"]["top_tokens"]]
    return body["generated_text"], tokens, tops


def test_tgi_grammar_writes_what_vllm_writes(pipeline_url, gateway_url, tolerance):
    text, tokens, tops = _tgi(pipeline_url)
    want, want_tokens, _ = _tgi(gateway_url)
    assert re.fullmatch(r" [0-9]{4}\.", text) and re.fullmatch(r" [0-9]{4}\.", want), (text, want)
    assert_greedy_or_near_tie(tokens, tops, want_tokens, tolerance)


# declctrl programs (built as pyaici.ast builds them) whose every generated step continues a
# count, forced text between (fast-forward), and one that backtracks to a label.
PROGRAMS = {
    "forced": ([ast.fixed("1, 2, 3,"), ast.gen(rx=r" \d+,", max_tokens=4), ast.fixed(" 5, 6,"),
                ast.gen(rx=r" \d+,", max_tokens=4)], r"1, 2, 3, 4, 5, 6, 7,"),
    "backtrack": ([ast.fixed("1, 2, 3,"), ast.label("four", ast.fixed(" 4,")),
                   ast.gen(rx=r" \d+,", max_tokens=4, set_var="next"),
                   ast.fixed(" 4, 5,", following="four"), ast.gen(rx=r" \d+,", max_tokens=4)],
                  r"1, 2, 3, 4, 5, ↩  4, 5, 6,"),
}


def _run(base_url: str, steps: list[dict]) -> dict:
    result = AiciClient(f"{base_url}/v1/").run(controller="declctrl",
                                               controller_arg={"steps": steps},
                                               temperature=0.0, max_tokens=60)
    assert result["error"] is None, result["error"]
    return result


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_declctrl_programs_run_as_on_vllm(pipeline_url, gateway_url, name):
    steps, text = PROGRAMS[name]
    got, want = _run(pipeline_url, steps), _run(gateway_url, steps)
    assert got["text"] == want["text"], (got["text"], want["text"])
    assert got["text"][0] == text, got["text"]
    assert got["response"][-1]["forks"][0]["finish_reason"] == "aici-stop"
    assert got["usage"]["ff_tokens"] > 1  # the forced text went in without sampling

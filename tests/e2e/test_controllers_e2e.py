"""Controllers end to end: openai SDK → Ray Serve → vLLM replica with the controller hook and
the runtime actor beside it (embedded model).

Oracles: the grammar itself (``re.fullmatch``, ``json.loads`` + the schema's rules) and vLLM's
own unconstrained distribution through the plain path (a masked greedy step must pick the
best token the mask allows).
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.e2e.conftest import MODEL

PROMPT = "Q: How many apples are in the basket?\nA: There are"
REGEX = r" [0-9]{2} apples\."


def _guidance_regex(pattern: str) -> dict:
    return {"grammar": {"grammars": [{"lark_grammar": f"start: /{pattern}/"}]}}


def _controlled(client):
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"controller": "llguidance",
                                                 "controller_arg": _guidance_regex(REGEX)})


def _ids(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"model": MODEL, "prompt": text,
                                        "add_special_tokens": False}).json()["tokens"]


def test_a_regex_controller_output_matches_and_each_sampled_step_is_the_best_allowed(
        openai_client, http):
    result = openai_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1,
        extra_body={"controller": "llguidance", "controller_arg": _guidance_regex(REGEX)})
    choice = result.choices[0]
    assert re.fullmatch(REGEX, choice.text), choice.text
    assert choice.finish_reason == "stop"  # the controller stopped at the grammar's end
    tokens = choice.logprobs.tokens
    assert "".join(tokens) == choice.text
    digits = [i for i, t in enumerate(tokens) if t.isdigit()]
    assert digits, tokens
    # The run's token ids: each token's text is one token of the vocabulary.
    ids = [_ids(http, t) for t in tokens]
    assert all(len(i) == 1 for i in ids), ids
    prompt_ids = _ids(http, PROMPT)
    for i in digits:
        # vLLM's own next-token distribution at that point (same ids, no retokenization),
        # unconstrained: the mask allows only digits there, so greedy picks the likeliest.
        plain = openai_client.completions.create(
            model=MODEL, prompt=prompt_ids + [t[0] for t in ids[:i]], max_tokens=1,
            temperature=0, logprobs=20)
        top = plain.choices[0].logprobs.top_logprobs[0]
        allowed = {t: lp for t, lp in top.items() if re.fullmatch(r"[0-9]+", t)}
        assert allowed, top
        # ties are common in this small model ('1' and '2' share a logprob): the pick must be
        # one of the best
        assert tokens[i] in allowed, (i, tokens, top)
        assert allowed[tokens[i]] >= max(allowed.values()) - 1e-6, (i, tokens, top)


def test_masks_that_do_not_bind_leave_greedy_output_as_vllm_alone(openai_client):
    plain = openai_client.completions.create(model=MODEL, prompt="The capital of France is",
                                             max_tokens=6, temperature=0)
    text = plain.choices[0].text
    controlled = openai_client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
        extra_body={"controller": "none"})
    assert controlled.choices[0].text == text
    assert controlled.usage.completion_tokens == 6 and controlled.choices[0].finish_reason == \
        "length"


def test_streaming_a_controlled_request_gives_the_same_text(openai_client):
    whole = _controlled(openai_client)
    chunks = list(openai_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        extra_body={"controller": "llguidance", "controller_arg": _guidance_regex(REGEX)}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert re.fullmatch(REGEX, whole.choices[0].text)


def test_chat_response_format_json_schema_gives_json_that_follows_it(openai_client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "sunny"],
              "properties": {"city": {"type": "string", "maxLength": 12},
                             "sunny": {"type": "boolean"}}}
    result = openai_client.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Describe the weather in Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    value = json.loads(result.choices[0].message.content)
    assert set(value) == {"city", "sunny"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 12
    assert isinstance(value["sunny"], bool)


@pytest.mark.parametrize("extra, param, needle", [
    ({"controller": "no-such"}, "controller", "unknown controller"),
    ({"controller": "llguidance", "controller_arg": {"grammar": {"grammars": [
        {"lark_grammar": "start: /[0-9/"}]}}}, "controller", "llguidance"),
    ({"controller": "llguidance", "controller_arg": "not json"}, "controller", "not JSON"),
    ({"controller": "none", "n": 2}, "n", "one choice"),
    ({"controller": "none", "stop": ["x"]}, "stop", "stop sequences"),
])
def test_bad_controller_requests_are_400_in_openai_shape(openai_client, extra, param, needle):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=MODEL, prompt="Hi", max_tokens=4,
                                          extra_body=extra)
    error = info.value.body
    assert error["param"] == param and needle in error["message"], error


def test_the_replica_serves_plain_requests_after_controller_failures(openai_client):
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model=MODEL, prompt="Hi", max_tokens=4,
                                          extra_body={"controller": "no-such"})
    result = openai_client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert result.usage.completion_tokens == 4


# --- the other protocols' controller fields, with their real clients where there is one -----

def test_tgi_grammar_regex_with_the_text_generation_client(gateway_url):
    import text_generation
    from text_generation.types import Grammar, GrammarType

    client = text_generation.Client(gateway_url, timeout=120)
    pattern = r" [0-9]{2} apples\."
    whole = client.generate(PROMPT, max_new_tokens=12,
                            grammar=Grammar(type=GrammarType.Regex, value=pattern))
    assert re.fullmatch(pattern, whole.generated_text), whole.generated_text
    assert whole.details.finish_reason == text_generation.types.FinishReason.EndOfSequenceToken
    stream = list(client.generate_stream(PROMPT, max_new_tokens=12,
                                         grammar=Grammar(type=GrammarType.Regex, value=pattern)))
    assert "".join(r.token.text for r in stream) == whole.generated_text
    assert [t.id for t in whole.details.tokens] == [r.token.id for r in stream]


def test_tgi_grammar_json_schema(gateway_url):
    import text_generation
    from text_generation.types import Grammar, GrammarType

    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    client = text_generation.Client(gateway_url, timeout=120)
    result = client.generate("How many apples? Answer in JSON: ", max_new_tokens=24,
                             grammar=Grammar(type=GrammarType.Json, value=schema))
    value = json.loads(result.generated_text)
    assert set(value) == {"n"} and isinstance(value["n"], int) and 0 <= value["n"] <= 99


def test_lmi_and_mindie_parameters_controller(http):
    arg = _guidance_regex(REGEX)
    lmi = http.post("/invocations", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 12, "controller": "llguidance", "controller_arg": arg}})
    assert lmi.status_code == 200, lmi.text
    text = lmi.json()["generated_text"]
    assert re.fullmatch(REGEX, text), text
    mindie = http.post(f"/v2/models/{MODEL}/generate", json={"text_input": PROMPT, "parameters": {
        "max_new_tokens": 12, "controller": "llguidance", "controller_arg": arg}})
    assert mindie.status_code == 200, mindie.text
    assert mindie.json()["text_output"] == text
    bad = http.post(f"/v2/models/{MODEL}/generate", json={"text_input": PROMPT, "parameters": {
        "controller": "no-such"}})
    assert bad.status_code == 422 and "unknown controller" in bad.json()["error"], bad.text


async def test_lmtp_generate_with_a_controller_streams_forced_and_masked_tokens(gateway_url):
    import asyncio

    import httpx
    import websockets

    ids = httpx.post(f"{gateway_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    url = gateway_url.replace("http://", "ws://") + "/"
    items: list[dict] = []
    async with websockets.connect(url) as ws:
        await ws.send("GENERATE " + json.dumps({
            "model": MODEL, "prompt": ids, "stream_id": 1, "max_tokens": 12,
            "controller": "llguidance", "controller_arg": _guidance_regex(REGEX)}))
        async with asyncio.timeout(120):
            while not items or not (items[-1].get("finish_reason") or items[-1].get("error")):
                kind, _, body = (await ws.recv()).partition(" ")
                assert kind == "TOKEN", body
                items += json.loads(body)
    assert all(i.get("error") is None for i in items), items
    assert items[-1]["finish_reason"] == "stop"
    detok = httpx.post(f"{gateway_url}/detokenize",
                       json={"tokens": [i["token"] for i in items]}).json()["prompt"]
    assert re.fullmatch(REGEX, detok), (detok, items)


# --- backtrack + fast-forward: the operator's example controller (engines/controllers/examples)

REDACT_PROMPT = "The capital of France is"
# Long enough that a resubmission finds a whole block in vLLM's prefix cache (128 tokens per
# block on CPUs, vLLM's CPU default; 16 on GPUs).
LONG_PROMPT = ("Facts about Europe. Germany is a country in central Europe; its capital is "
               "Berlin, on the river Spree. Italy is a country in southern Europe; its capital "
               "is Rome, on the river Tiber. Spain is a country in south-western Europe; its "
               "capital is Madrid. Portugal is a country on the Atlantic coast; its capital is "
               "Lisbon, on the river Tagus. Austria is a country in the Alps; its capital is "
               "Vienna, on the river Danube. Hungary is a country in central Europe; its capital "
               "is Budapest, also on the Danube. Poland is a country in central Europe; its "
               "capital is Warsaw, on the river Vistula. France is a country in western Europe. "
               "The capital of France is")
REDACT = {"words": ["Paris"], "replacement": "[redacted]"}


async def test_a_backtrack_resubmits_and_the_continuation_equals_one_pass_over_that_prefix(
        engine_handle):
    """The engine's own events (no protocol): the controller withdraws the tokens that spell
    the word and forces the replacement; what follows must be what vLLM alone generates,
    greedily, from prompt + kept + forced tokens in one pass (vLLM's own API, no controller)."""
    from contract import (
        BacktrackEvent,
        ControllerSpec,
        FinalEvent,
        GenerateRequest,
        OutputOptions,
        Sampling,
        TextPrompt,
        TokenEvent,
    )
    from gateway.ingress.engine_client import ServeEngineClient

    client = ServeEngineClient(engine_handle, MODEL, monitor_interval_s=None)
    request = GenerateRequest(
        request_id="redact-e2e", model=MODEL, prompt=TextPrompt(text=LONG_PROMPT),
        sampling=Sampling(temperature=0, max_tokens=16), output=OutputOptions(splices="full"),
        controller=ControllerSpec(module="redact", arg=json.dumps(REDACT)))
    ids: list[int] = []
    texts: list[str] = []
    last_forced = 0
    backtracks = []
    final = None
    async for event in client.generate(request):
        if isinstance(event, TokenEvent):
            ids.append(event.token_id)
            texts.append(event.text)
            if event.forced:
                last_forced = len(ids)
        elif isinstance(event, BacktrackEvent):
            backtracks.append(event)
            assert "".join(texts[-event.count:]) == event.text
            del ids[-event.count:], texts[-event.count:]
        elif isinstance(event, FinalEvent):
            final = event
        else:
            raise AssertionError(event)
    assert backtracks and all("Paris" in b.text for b in backtracks), backtracks
    text = "".join(texts)
    assert "Paris" not in text and "[redacted]" in text, text
    assert final is not None and final.finish_reason == "length" and len(ids) == 16
    assert final.usage.completion_tokens == 16 and final.usage.forced_tokens >= 1
    assert final.usage.sampled_tokens == 16 - final.usage.forced_tokens + sum(
        b.count for b in backtracks)
    # the resubmission after the edit prefilled its prompt's whole blocks from the cache
    assert final.usage.prompt_tokens > 128 and final.usage.cached_tokens >= 128, final.usage
    prompt_ids = (await engine_handle.reference_greedy.remote(LONG_PROMPT, 1)).prompt_token_ids
    rest = ids[last_forced:]
    assert rest, "nothing generated after the forced tokens"
    reference = await engine_handle.reference_greedy.remote(prompt_ids + ids[:last_forced],
                                                            len(rest))
    assert rest == reference.token_ids, (text, reference.text)


def test_backtracks_in_each_protocol(openai_client, gateway_url):
    import httpx

    extra = {"controller": "redact", "controller_arg": REDACT}
    # A whole OpenAI response applies the backtrack: the word is gone.
    whole = openai_client.completions.create(model=MODEL, prompt=REDACT_PROMPT, max_tokens=12,
                                             temperature=0, extra_body=extra)
    text = whole.choices[0].text
    assert "[redacted]" in text and "Paris" not in text, text
    # An OpenAI stream cannot take text back: it ends with an error saying so.
    with pytest.raises(openai.APIError, match="withdrew tokens"):
        for _ in openai_client.completions.create(model=MODEL, prompt=REDACT_PROMPT,
                                                  max_tokens=12, temperature=0, stream=True,
                                                  extra_body=extra):
            pass
    # AICI's stream shows it as AICI does: " ↩ " and nothing retracted (with a prompt, which
    # AICI's REST API takes though pyaici's run_controller sends none).
    r = httpx.post(f"{gateway_url}/v1/run", timeout=120, json={
        "controller": "redact", "controller_arg": REDACT, "prompt": REDACT_PROMPT,
        "max_tokens": 12})
    lines = [line for line in r.text.split("\n") if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    forks = [f for line in lines[1:-1] for f in json.loads(line[6:])["forks"]]
    text = "".join(f["text"] for f in forks)
    assert "Paris ↩  [redacted]" in text and not any(f["error"] for f in forks), text
    assert forks[-1]["finish_reason"] == "length"

"""The pipeline engine kind end to end: the embedded model split into 3 Ray stage actors behind
Ray Serve, reached by each protocol's real client. Oracle: the unsplit HF model's greedy
``generate`` (``reference_greedy`` on the pipeline replica), never the pipeline itself."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import websockets

from tests.serve_session import PIPELINE_MODEL

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
TOKENS = 12


@pytest.fixture(scope="module")
def reference(pipeline_handle):
    return pipeline_handle.reference_greedy.remote(PROMPT, TOKENS).result()


@pytest.fixture
def http(pipeline_url):
    with httpx.Client(base_url=pipeline_url, timeout=120) as client:
        yield client


def test_listing_names_the_engine_kind(http):
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [PIPELINE_MODEL]
    info = http.get("/info").json()  # TGI's /info
    assert info["model_id"] == PIPELINE_MODEL


def test_openai_sdk_greedy_equals_the_unsplit_model(pipeline_url, reference):
    from openai import OpenAI

    client = OpenAI(base_url=f"{pipeline_url}/v1", api_key="unused", max_retries=0, timeout=120)
    whole = client.completions.create(model=PIPELINE_MODEL, prompt=PROMPT, max_tokens=TOKENS,
                                      temperature=0, logprobs=1)
    assert whole.choices[0].text == reference.text
    assert whole.usage.completion_tokens == TOKENS
    for got, want in zip(whole.choices[0].logprobs.token_logprobs, reference.logprobs,
                         strict=True):
        assert got == pytest.approx(want, abs=1e-3)
    stream = client.completions.create(model=PIPELINE_MODEL, prompt=PROMPT, max_tokens=TOKENS,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference.text
    chat = client.chat.completions.create(model=PIPELINE_MODEL, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("length", "stop")


def test_controllers_on_the_pipeline_kind_with_the_openai_sdk_and_tgi(pipeline_url, http):
    """A grammar (llguidance) on the split model through the replica's own controller runtime,
    from OpenAI's extra body and from TGI's ``grammar`` parameter; oracle: the grammar."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{pipeline_url}/v1", api_key="unused", max_retries=0, timeout=120)
    grammar = {"grammar": {"grammars": [{"lark_grammar": 'start: "Paris is " /[a-z]{3,8}/'}]}}
    out = client.completions.create(model=PIPELINE_MODEL, prompt=PROMPT, max_tokens=16,
                                    temperature=0, extra_body={"controller": "llguidance",
                                                               "controller_arg": grammar})
    assert re.fullmatch(r"Paris is [a-z]{3,8}", out.choices[0].text), out.choices[0].text
    assert out.choices[0].finish_reason == "stop"
    tgi = http.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 12, "grammar": {"type": "regex", "value": "[0-9]{2,4}"}}})
    assert tgi.status_code == 200, tgi.text
    assert re.fullmatch(r"[0-9]{2,4}", tgi.json()["generated_text"]), tgi.json()


def test_tool_calls_on_the_pipeline_kind_validate(pipeline_url):
    """Tool calling rides the same controller hook on the split model (docs/protocols/tools.md);
    oracle: the function's schema."""
    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=f"{pipeline_url}/v1", api_key="unused", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
              "required": ["city"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=PIPELINE_MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": schema}}],
        tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1, out
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)


async def test_lmtp_generate_and_score(pipeline_url, reference):
    url = pipeline_url.replace("http://", "ws://") + "/"
    async with websockets.connect(url) as ws:
        await ws.send("GENERATE " + json.dumps({"model": PIPELINE_MODEL, "stream_id": 1,
                                                "prompt": reference.prompt_token_ids,
                                                "max_tokens": TOKENS}))
        items = await _lmtp_items(ws, 1)
        assert [i["token"] for i in items] == reference.token_ids
        await ws.send("SCORE " + json.dumps({"model": PIPELINE_MODEL, "stream_id": 2,
                                             "prompt": reference.prompt_token_ids,
                                             "scored": reference.token_ids[:5]}))
        scored = await _lmtp_items(ws, 2)
    for got, want in zip([i["logprob"] for i in scored], reference.logprobs[:5], strict=True):
        assert got == pytest.approx(want, abs=1e-3)  # fp32 stages: prefill == decode


async def _lmtp_items(ws, sid: int) -> list[dict]:
    items: list[dict] = []
    async with asyncio.timeout(120):
        while True:
            _, _, body = (await ws.recv()).partition(" ")
            for item in json.loads(body):
                assert item["stream_id"] == sid and item.get("error") is None, item
                items.append(item)
                if item.get("finish_reason"):
                    return items


def test_tgi_client_and_lmi(pipeline_url, http, reference):
    import text_generation

    tgi = text_generation.Client(pipeline_url, timeout=120)
    answer = tgi.generate(PROMPT, max_new_tokens=TOKENS, decoder_input_details=False)
    assert answer.generated_text == reference.text
    assert [t.id for t in answer.details.tokens] == reference.token_ids
    lmi = http.post("/invocations", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": TOKENS, "do_sample": False, "details": True}})
    assert lmi.status_code == 200, lmi.text
    assert lmi.json()["generated_text"] == reference.text


def test_mindie_stream_concatenates_to_the_reference(http, reference):
    with http.stream("POST", f"/v2/models/{PIPELINE_MODEL}/generate_stream", json={
            "text_input": PROMPT, "parameters": {"max_new_tokens": TOKENS}}) as response:
        assert response.status_code == 200
        events = [json.loads(line[5:]) for line in response.iter_lines()
                  if line.startswith("data:")]
    assert "".join(e["text_output"] for e in events) == reference.text


def test_too_long_prompt_is_the_protocols_400(http):
    response = http.post("/v1/completions", json={"model": PIPELINE_MODEL,
                                                  "prompt": [1] * 5000, "max_tokens": 1})
    assert response.status_code == 400
    assert "maximum context length" in response.json()["error"]["message"]


def test_a_killed_middle_stage_is_respawned_and_the_stream_goes_on(pipeline_url, pipeline_handle):
    """Kill the middle stage after the 3rd streamed token: the replica respawns it, re-prefills
    from its tokens, and the client gets the unsplit model's tokens, none twice or lost."""
    import ray
    from openai import OpenAI

    want = pipeline_handle.reference_greedy.remote(PROMPT, 30).result()
    client = OpenAI(base_url=f"{pipeline_url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(model=PIPELINE_MODEL, prompt=PROMPT, max_tokens=30,
                                       temperature=0, stream=True)
    tokens: list[str] = []
    killed = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            tokens.append(chunk.choices[0].text)
        if len(tokens) >= 3 and killed is None:
            killed = _stage_names()[1]
            ray.kill(ray.get_actor(*killed))
    assert killed is not None
    assert "".join(tokens) == want.text
    assert killed not in _stage_names() and len(_stage_names()) == 3


def _stage_names() -> list[tuple[str, str]]:
    """(name, namespace) of the pipeline's live stage actors, in stage order."""
    import ray

    return sorted((a["name"], a["namespace"])
                  for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"{PIPELINE_MODEL}:stage"))


def test_stages_on_two_nodes_give_the_same_answer():
    """A head and a worker node (distinct custom resources): stages placed by those resources,
    and by a STRICT_SPREAD placement group, land on different nodes; the tokens are the unsplit
    model's. Its own Ray cluster, in a subprocess (the session's Ray stays untouched)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tests.e2e.pipeline_two_nodes"],
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["nodes"] == 2
    ids = result["node_ids"]
    assert result["resources"]["nodes"] == [ids["node_a"], ids["node_b"]]
    assert len(set(result["strict_spread"]["nodes"])) == 2
    assert result["resources"]["tokens"] == result["reference"]
    assert result["strict_spread"]["tokens"] == result["reference"]


def test_a_client_disconnect_frees_every_stage_cache(http, pipeline_handle):
    """Close an SSE stream of a long request after a few events: the replica aborts it (the
    abort is counted) and every stage drops the sequence's cache (asked of the actors)."""
    import time

    import ray

    aborted = pipeline_handle.stats.remote().result().aborted
    with http.stream("POST", "/v1/completions", json={
            "model": PIPELINE_MODEL, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    stages = [ray.get_actor(*name) for name in _stage_names()]
    deadline = time.monotonic() + 30  # 3000 tokens take minutes: only an abort ends it here
    while pipeline_handle.stats.remote().result().aborted == aborted or any(
            ray.get([s.cached.remote() for s in stages])):
        assert time.monotonic() < deadline, "not aborted, or a stage still holds its cache"
        time.sleep(0.2)
    assert pipeline_handle.stats.remote().result().active == 0


def test_the_health_check_respawns_a_stage_that_died_while_idle(pipeline_handle, http, reference):
    import ray

    victim = _stage_names()[0]
    ray.kill(ray.get_actor(*victim))
    pipeline_handle.check_health.remote().result()  # healthy again: the stage was respawned
    names = _stage_names()
    assert victim not in names and len(names) == 3
    answer = http.post("/v1/completions", json={"model": PIPELINE_MODEL, "prompt": PROMPT,
                                                "max_tokens": TOKENS, "temperature": 0})
    assert answer.json()["choices"][0]["text"] == reference.text


def test_sixteen_clients_at_once_over_every_protocol_each_get_the_unsplit_answer(
        pipeline_url, pipeline_handle):
    """16 clients at once, four protocols' real clients, prompts of four lengths: the replica
    runs them as micro-batches, and each gets what the unsplit model gives that prompt alone."""
    from concurrent.futures import ThreadPoolExecutor

    import text_generation
    from openai import OpenAI

    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea,",
               "1, 2, 3,", "Water boils at a temperature of one hundred degrees Celsius, and"]
    want = {p: pipeline_handle.reference_greedy.remote(p, TOKENS).result().text for p in prompts}
    openai = OpenAI(base_url=f"{pipeline_url}/v1", api_key="unused", max_retries=0, timeout=300)
    tgi = text_generation.Client(pipeline_url, timeout=300)

    def ask(i: int) -> tuple[str, str]:
        prompt = prompts[i % 4]
        if i // 4 == 0:
            return prompt, openai.completions.create(
                model=PIPELINE_MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0
            ).choices[0].text
        if i // 4 == 1:
            return prompt, tgi.generate(prompt, max_new_tokens=TOKENS).generated_text
        with httpx.Client(base_url=pipeline_url, timeout=300) as http:
            if i // 4 == 2:
                return prompt, http.post("/invocations", json={"inputs": prompt, "parameters": {
                    "max_new_tokens": TOKENS, "do_sample": False}}).json()["generated_text"]
            with http.stream("POST", f"/v2/models/{PIPELINE_MODEL}/generate_stream", json={
                    "text_input": prompt, "parameters": {"max_new_tokens": TOKENS}}) as response:
                return prompt, "".join(json.loads(line[5:])["text_output"]
                                       for line in response.iter_lines()
                                       if line.startswith("data:"))

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert [text for _, text in answers] == [want[prompt] for prompt, _ in answers]

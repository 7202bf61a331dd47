"""OpenAI routes in-process over the fake engine (httpx.ASGITransport)."""

import json

import pytest

from contract import ChatPrompt, TextPrompt, TokenPrompt


def _sse(text: str) -> list:
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def _assert_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


async def test_models_lists_id_and_root(client):
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    card = body["data"][0]
    # The source path stays private unless expose_model_paths is set (test_reliability.py).
    assert card["id"] == "fake-model" and card["root"] == "fake-model"
    assert card["max_model_len"] == 64
    assert (await client.get("/v1/models/fake-model")).json()["id"] == "fake-model"
    _assert_error(await client.get("/v1/models/nope"), 404, "model")


async def test_completion_non_stream(client, engine):
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "Hi",
                                                   "max_tokens": 5, "temperature": 0})
    body = r.json()
    assert r.status_code == 200
    assert body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0}}
    sent = engine.requests[-1]
    assert sent.prompt == TextPrompt(text="Hi") and sent.sampling.temperature == 0
    assert sent.sampling.max_tokens == 5


async def test_completion_default_max_tokens_is_16(client, engine):
    await client.post("/v1/completions", json={"prompt": "Hi"})  # single model: name optional
    assert engine.requests[-1].sampling.max_tokens == 16


async def test_completion_stream_with_usage(client):
    r = await client.post("/v1/completions", json={
        "model": "fake-model", "prompt": "Hi", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hel"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


async def test_completion_stop_and_n(client, engine):
    r = await client.post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 10, "n": 2, "stop": "ll", "seed": 3})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["text"] == "Hell" and c["finish_reason"] == "stop" for c in choices)
    assert choices[0]["stop_reason"] == "ll"
    assert engine.requests[-1].sampling.seed == 3


async def test_completion_batch_prompts_and_token_ids(client, engine):
    r = await client.post("/v1/completions", json={"prompt": [[72, 105], [72]], "max_tokens": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 3
    assert {req.prompt for req in engine.requests[-2:]} == {TokenPrompt(token_ids=(72, 105)),
                                                           TokenPrompt(token_ids=(72,))}


async def test_completion_echo_and_logprobs(client):
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "echo": True,
                                                   "logprobs": 1})
    choice = r.json()["choices"][0]
    assert choice["text"] == "HiHe"
    # The prompt's tokens first, as OpenAI (and vLLM) list them: no logprob for the first one.
    lp = choice["logprobs"]
    assert lp["tokens"] == ["H", "i", "H", "e"]
    assert lp["token_logprobs"] == [None, -1.0, pytest.approx(-0.1), pytest.approx(-0.2)]
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"]) == 4
    streamed = await client.post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    lists = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for part in lists for t in part["tokens"]] == lp["tokens"]
    assert [t for part in lists for t in part["text_offset"]] == lp["text_offset"]


async def test_completion_prompt_logprobs_in_vllms_shape(client, engine):
    r = await client.post("/v1/completions", json={
        "prompt": [[72, 105], [72, 105, 33]], "max_tokens": 2, "n": 2, "prompt_logprobs": 0})
    choices = r.json()["choices"]
    assert engine.requests[-1].output.prompt_logprobs == 0
    # Per choice, vLLM's field: None for the first position, then the prompt token by id with
    # its logprob, rank and text (the fake engine scores position i at -i, rank i).
    first = [None, {"105": {"logprob": -1.0, "rank": 1, "decoded_token": "i"}}]
    second = [*first, {"33": {"logprob": -2.0, "rank": 2, "decoded_token": "!"}}]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["prompt_logprobs"] for c in choices] == [first, first, second, second]
    assert choices[0]["logprobs"] is None and choices[0]["text"] == "He"
    plain = (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})).json()
    assert plain["choices"][0]["prompt_logprobs"] is None  # vLLM's field, null unasked
    assert engine.requests[-1].output.prompt_logprobs is None


async def test_chat_prompt_logprobs_beside_the_choices(client):
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    body = r.json()
    scores = body["prompt_logprobs"]
    assert scores[0] is None and len(scores) > 2
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] == i
               for i, entry in enumerate(scores[1:], start=1))
    assert "prompt_logprobs" not in body["choices"][0]
    plain = (await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})).json()
    assert plain["prompt_logprobs"] is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_prompt_logprobs_in_a_stream_are_refused_as_vllm_does(client, engine, path):
    body = {"prompt": "Hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "Hi"}]}
    r = await client.post(path, json={**body, "stream": True, "prompt_logprobs": 2})
    _assert_error(r, 400, "prompt_logprobs")
    r = await client.post(path, json={**body, "stream": True, "prompt_logprobs": 0,
                                      "max_tokens": 1})
    assert r.status_code == 200  # accepted, nothing to send (vLLM's behaviour)
    assert engine.requests[-1].output.prompt_logprobs is None


async def test_chat_non_stream_and_list_content(client, engine):
    r = await client.post("/v1/chat/completions", json={
        "model": "fake-model", "max_completion_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hell"}
    assert isinstance(engine.requests[-1].prompt, ChatPrompt)
    assert engine.requests[-1].sampling.max_tokens == 4


async def test_chat_stream_natural_eos(client):
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "stream": True, "logprobs": True,
        "top_logprobs": 1, "stream_options": {"include_usage": True}})
    chunks = _sse(r.text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello world"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish[0]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == len("Hello world") + 1  # + EOS


async def test_ignore_eos_is_passed_through(client, engine):
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20,
                                                   "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 20
    assert engine.requests[-1].sampling.ignore_eos


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": 3}, None),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
])
async def test_completion_bad_input_is_400(client, body, param):
    _assert_error(await client.post("/v1/completions", json=body), 400, param)


async def test_engine_validation_error_is_400_not_a_stream(client):
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 500,
                                                   "stream": True})
    _assert_error(r, 400, "max_tokens")


async def test_empty_prompt_is_400(client):
    _assert_error(await client.post("/v1/completions", json={"prompt": ""}), 400, "prompt")


async def test_malformed_json_and_empty_body(client):
    _assert_error(await client.post("/v1/completions", content=b"{not json",
                                    headers={"content-type": "application/json"}), 400)
    _assert_error(await client.post("/v1/completions", content=b""), 400)
    _assert_error(await client.post("/v1/chat/completions", json=[1, 2]), 400)


async def test_unknown_model_is_404(client):
    error = _assert_error(await client.post("/v1/completions",
                                            json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert "gpt-9" in error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"content": "x"}]}, "messages"),
])
async def test_chat_bad_input_is_400(client, body, param):
    _assert_error(await client.post("/v1/chat/completions", json=body), 400, param)


async def test_unknown_route_is_openai_404(client):
    _assert_error(await client.get("/v1/nothing-here"), 404)


async def test_tokenize_detokenize_round_trip(client):
    r = (await client.post("/tokenize", json={"prompt": "Hi!", "return_token_strs": True})).json()
    assert r == {"count": 3, "max_model_len": 64, "tokens": [72, 105, 33],
                 "token_strs": ["H", "i", "!"]}
    assert (await client.post("/detokenize", json={"tokens": r["tokens"]})).json() == {
        "prompt": "Hi!"}
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]}))
    assert chat.json()["count"] == len("<user>a<assistant>")
    _assert_error(await client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    _assert_error(await client.post("/tokenize", json={}), 400, "prompt")


async def test_health_version_metrics(client):
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/version")).json()["version"]
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    metrics = (await client.get("/metrics")).text
    assert 'gateway_http_requests_total{path="/v1/completions",status="200"}' in metrics


async def test_api_key_required_when_configured(engine):
    import httpx

    from gateway.config import GatewayConfig
    from gateway.ingress.asgi import create_app
    from gateway.ingress.registry import ModelRegistry

    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig(api_key="s3cret"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as c:
        _assert_error(await c.get("/v1/models"), 401)
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert (await c.get("/health")).status_code == 200
        # The scheme is case-insensitive (issue 15: "bearer x" was a 401); the key is not.
        for header in ("bearer s3cret", "BEARER  s3cret"):
            assert (await c.get("/v1/models", headers={"Authorization": header})).status_code == 200
        for header in ("Bearer S3CRET", "Bearer s3cre", "Basic s3cret", "s3cret", "Bearer"):
            _assert_error(await c.get("/v1/models", headers={"Authorization": header}), 401)


async def test_deeply_nested_json_is_400_not_500(client):
    body = b'{"prompt": "x", "foo": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _assert_error(await client.post("/v1/completions", content=body,
                                    headers={"content-type": "application/json"}), 400)


async def test_temperature_above_two_is_400(client):
    _assert_error(await client.post("/v1/completions", json={"prompt": "x", "temperature": 2.5}),
                  400, "temperature")


@pytest.mark.parametrize("field", ["priority", "seed"])
@pytest.mark.parametrize("value", [2**64, -(2**63) - 1])
async def test_integers_beyond_64_bits_are_a_400_naming_the_field(client, field, value):
    """Found by fuzzing (issue 15): they used to pass validation and fail in vLLM's engine core
    (msgpack), answered as a 500 "engine failure"."""
    for route, body in (("/v1/completions", {"prompt": "Hi"}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "Hi"}]})):
        r = await client.post(route, json={"model": "fake-model", "max_tokens": 2, **body,
                                           field: value})
        error = _assert_error(r, 400)
        assert field in error["message"] or error["param"] == field


async def test_prompt_lists_times_n_are_bounded_by_max_fanout(engine):
    """Issue 15: a prompt list of 2,000 (x n up to 128) used to start every engine request."""
    import httpx

    from gateway.config import GatewayConfig
    from gateway.ingress.asgi import create_app
    from gateway.ingress.registry import ModelRegistry

    app = create_app(ModelRegistry({"fake-model": engine}), GatewayConfig(max_fanout=6))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as c:
        before = len(engine.requests)
        r = await c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3,
                                                  "max_tokens": 2})
        assert "at most 6" in _assert_error(r, 400, "prompt")["message"]
        r = await c.post("/v1/completions", json={"prompt": ["a"] * 7, "max_tokens": 2,
                                                  "stream": True})
        _assert_error(r, 400, "prompt")
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "n": 7, "max_tokens": 2})
        _assert_error(r, 400, "n")
        assert len(engine.requests) == before  # refused before any engine request
        ok = await c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3,
                                                   "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 6

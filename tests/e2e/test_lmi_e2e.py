"""SageMaker / DJL LMI (``/invocations``, ``/predictions``) and Hugging Face TGI (``/generate``,
``/generate_stream``, ``POST /``) end to end against real vLLM: raw bytes for the framings, the
real ``text-generation`` (strict, pydantic) and ``huggingface_hub.InferenceClient`` clients for
what TGI users run, and a second in-process app for LMI's TGI-compatible mode."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import text_generation
from huggingface_hub import InferenceClient
from text_generation.errors import ValidationError as TGIValidationError

from engines.kit.config import ModelConfig
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.engine_client import ServeEngineClient
from gateway.ingress.registry import ModelRegistry
from tests.e2e.aborts import drop_stream, engine_stats, wait_for_abort
from tests.e2e.conftest import MODEL
from tests.seed_examples import LMI_SEED_ERROR, LMI_SEED_REQUEST
from tests.serve_session import serve_in_thread

PROMPT = "The capital of France is"
# Greedy ends on <|im_end|> after 13 tokens (checked below), so ignore_eos_token is observable.
EOS_PROMPT = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"
FINISH_REASONS = {"length", "eos_token", "stop_sequence"}
LMI_TOKEN_KEYS = {"id", "text", "log_prob"}
TGI_TOKEN_KEYS = {"id", "text", "logprob", "special"}
LONG = {"max_new_tokens": 1500, "ignore_eos_token": True}  # runs until aborted


# --- helpers --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def native(engine_handle):
    """vLLM's own greedy completion (bypassing the gateway), cached per (prompt, max_tokens)."""
    cache: dict[tuple[str, int], dict] = {}

    def get(prompt: str, max_tokens: int) -> dict:
        if (prompt, max_tokens) not in cache:
            cache[prompt, max_tokens] = msgspec.structs.asdict(
                engine_handle.reference_greedy.remote(prompt, max_tokens).result())
        return cache[prompt, max_tokens]

    return get


def _lmi(http: httpx.Client, body: dict, path: str = "/invocations", **kwargs) -> dict | list:
    response = http.post(path, json=body, **kwargs)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def _jsonlines(http: httpx.Client, body: dict, path: str = "/invocations",
               headers: dict | None = None) -> list[dict]:
    """Raw LMI jsonlines: one JSON object per newline-terminated line, no ``data:`` prefix."""
    with http.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("application/jsonlines")
        raw = response.read().decode()
    assert raw.endswith("\n") and not raw.endswith("\n\n"), raw[-200:]
    lines = raw[:-1].split("\n")
    assert all(line.startswith("{") for line in lines), raw[:300]
    objects = [json.loads(line) for line in lines]
    assert all(isinstance(o, dict) for o in objects)
    return objects


def _sse(http: httpx.Client, body: dict, path: str, prefix: str | tuple[str, ...],
         headers: dict | None = None) -> list[dict]:
    """Raw SSE: every event is ``<prefix>{json}`` plus a blank line; no [DONE], no comments."""
    prefixes = (prefix,) if isinstance(prefix, str) else prefix
    with http.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("\n\n"), raw[-200:]
    assert "[DONE]" not in raw
    assert not any(line.startswith(":") for line in raw.split("\n")), raw[:300]
    frames = raw[:-2].split("\n\n")
    assert all(f.startswith(tuple(p + "{" for p in prefixes)) for f in frames), raw[:300]
    return [json.loads(f.partition(":")[2]) for f in frames]


def _check_lmi_tokens(tokens: list[dict]) -> None:
    for token in tokens:
        extra = set(token) - LMI_TOKEN_KEYS
        assert LMI_TOKEN_KEYS <= set(token) and extra <= {"special_token"}, token
        assert token.get("special_token", True) is True  # only written when true
        assert isinstance(token["id"], int) and isinstance(token["text"], str)
        assert isinstance(token["log_prob"], float) and token["log_prob"] <= 0


def _plain_text(tokens: list[dict]) -> str:
    """The texts of the non-special tokens, which concatenate to ``generated_text``."""
    return "".join(t["text"] for t in tokens if not t.get("special_token"))


def _cumulative(tokens: list[dict]) -> float:
    return sum(t["log_prob"] for t in tokens)


@pytest.fixture(scope="module")
def compat_url(engine_handle) -> Iterator[str]:
    """A second gateway app in LMI's TGI-compatible mode over the session's engine."""
    registry = ModelRegistry({MODEL: ServeEngineClient(engine_handle)})
    with serve_in_thread(create_app(registry, GatewayConfig(lmi_tgi_compat=True))) as url:
        yield url


@pytest.fixture(scope="module")
def two_model_url(engine_handle) -> Iterator[str]:
    """Two model names (one engine), LMI's ``output_formatter=sse`` and TGI on the second."""
    client = ServeEngineClient(engine_handle)
    config = GatewayConfig(models=[ModelConfig(name=MODEL), ModelConfig(name="second")],
                           lmi_output_formatter="sse", tgi_model="second")
    registry = ModelRegistry({MODEL: client, "second": client})
    with serve_in_thread(create_app(registry, config)) as url:
        yield url


# --- LMI rolling batch ----------------------------------------------------------------------


def test_rolling_batch_details_match_vllm_greedy(http, native):
    expected = native(PROMPT, 8)
    body = _lmi(http, {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "details": True}})
    assert set(body) == {"generated_text", "details"}
    details = body["details"]
    assert set(details) == {"finish_reason", "generated_tokens", "inputs", "tokens"}
    assert details["finish_reason"] in FINISH_REASONS
    assert details["inputs"] == PROMPT
    tokens = details["tokens"]
    _check_lmi_tokens(tokens)
    assert details["generated_tokens"] == len(tokens) <= 8
    assert body["generated_text"] == expected["text"]
    assert [t["id"] for t in tokens] == expected["token_ids"]
    assert [t["log_prob"] for t in tokens] == pytest.approx(expected["logprobs"], abs=1e-3)
    assert "".join(t["text"] for t in tokens) == body["generated_text"]
    assert "Paris" in body["generated_text"]


def test_without_details_the_body_is_only_generated_text(http, native):
    body = _lmi(http, {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}})
    assert body == {"generated_text": native(PROMPT, 8)["text"]}


def test_seed_request_streams_jsonlines_token_by_token(http):
    request = {**LMI_SEED_REQUEST,
               "parameters": {**LMI_SEED_REQUEST["parameters"], "max_new_tokens": 16}}
    lines = _jsonlines(http, request)
    assert all(set(line) == {"token"} for line in lines[:-1])
    last = lines[-1]
    assert set(last) == {"token", "generated_text", "details"}
    details = last["details"]
    assert set(details) == {"finish_reason", "generated_tokens", "inputs"}  # no tokens
    assert details["finish_reason"] in FINISH_REASONS
    assert details["inputs"] == LMI_SEED_REQUEST["inputs"]
    assert details["generated_tokens"] == len(lines) <= 16  # one token per line
    tokens = [line["token"] for line in lines]
    _check_lmi_tokens(tokens)
    assert _plain_text(tokens) == last["generated_text"]


def test_greedy_jsonlines_stream_equals_non_stream(http):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True}}
    whole = _lmi(http, body)
    lines = _jsonlines(http, {**body, "stream": True})
    assert [line["token"] for line in lines] == whole["details"]["tokens"]
    assert lines[-1]["generated_text"] == whole["generated_text"]
    assert "".join(line["token"]["text"] for line in lines) == whole["generated_text"]
    assert lines[-1]["details"] == {k: v for k, v in whole["details"].items() if k != "tokens"}


def test_stream_without_details_has_no_details_line(http):
    lines = _jsonlines(http, {"inputs": PROMPT, "parameters": {"max_new_tokens": 4},
                              "stream": True})
    assert len(lines) == 4
    assert set(lines[-1]) == {"token", "generated_text"}


def test_accept_event_stream_gives_sse_with_a_space_and_the_same_objects(http):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True},
            "stream": True}
    events = _sse(http, body, "/invocations", "data: ", headers={"Accept": "text/event-stream"})
    assert events == _jsonlines(http, body)
    assert events[-1]["details"]["generated_tokens"] == len(events)


def test_predictions_routes_and_model_selection(http, native):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6}}
    expected = {"generated_text": native(PROMPT, 6)["text"]}
    assert _lmi(http, body, f"/predictions/{MODEL}") == expected
    assert _lmi(http, body, f"/predictions/{MODEL}/1") == expected
    assert _lmi(http, body, f"/models/{MODEL}/invoke") == expected
    assert _lmi(http, body, "/invocations", params={"model_name": MODEL}) == expected
    assert _lmi(http, body, "/invocations", headers={"model_name": MODEL}) == expected
    assert _lmi(http, {**body, "model_name": MODEL}) == expected
    for response in (http.post("/predictions/nope", json=body),
                     http.post("/models/nope/invoke", json=body),
                     http.post("/invocations", json=body, params={"model_name": "nope"}),
                     http.post("/invocations", json=body, headers={"model_name": "nope"})):
        assert response.status_code == 404, response.text
        error = response.json()
        assert set(error) == {"code", "type", "message"} and error["code"] == 404
        assert "nope" in error["message"]


def test_models_listing_and_ping(http):
    models = http.get("/models").json()["models"]
    assert [m["modelName"] for m in models] == [MODEL]
    ping = http.get("/ping")
    assert ping.status_code == 200 and ping.json() == {MODEL: "Healthy"}
    metrics = http.get("/server/metrics")  # DJL's Prometheus path
    assert metrics.status_code == 200 and "# TYPE" in metrics.text


def test_decoder_input_details_fills_prefill(http, native):
    prompt_ids = native(PROMPT, 2)["prompt_token_ids"]
    body = {"inputs": PROMPT,
            "parameters": {"max_new_tokens": 2, "details": True, "decoder_input_details": True}}
    for prefill in (_lmi(http, body)["details"]["prefill"],
                    _jsonlines(http, {**body, "stream": True})[-1]["details"]["prefill"]):
        assert [p["id"] for p in prefill] == prompt_ids  # one entry per prompt token
        assert all(set(p) == LMI_TOKEN_KEYS for p in prefill)
        assert prefill[0]["log_prob"] is None
        assert all(isinstance(p["log_prob"], float) and p["log_prob"] <= 0 for p in prefill[1:])
        assert "".join(p["text"] for p in prefill) == PROMPT


def test_return_full_text_prefixes_the_prompt(http, native):
    generated = native(PROMPT, 6)["text"]
    body = {"inputs": PROMPT,
            "parameters": {"max_new_tokens": 6, "return_full_text": True, "details": True}}
    whole = _lmi(http, body)
    assert whole["generated_text"] == PROMPT + generated
    assert "".join(t["text"] for t in whole["details"]["tokens"]) == generated
    lines = _jsonlines(http, {**body, "stream": True})
    assert lines[-1]["generated_text"] == PROMPT + generated


def _stop_word(free_text: str) -> str:
    words = free_text.split()
    assert len(words) >= 3, free_text
    return words[2]


@pytest.mark.parametrize("spelling", ["stop_sequences", "stop", "stop_as_string"])
def test_stop_sequences_and_stop_end_with_stop_sequence(http, native, spelling):
    free = native(PROMPT, 12)["text"]
    stop = _stop_word(free)  # a word greedy decoding reaches after a few tokens
    key, value = ("stop", stop) if spelling == "stop_as_string" else (spelling, [stop])
    body = _lmi(http, {"inputs": PROMPT,
                       "parameters": {"max_new_tokens": 12, "details": True, key: value}})
    details = body["details"]
    assert details["finish_reason"] == "stop_sequence"
    assert body["generated_text"] == free[:free.index(stop)]
    assert details["generated_tokens"] == len(details["tokens"]) < 12
    # the tokens that matched the stop string keep their text; generated_text drops it (vLLM)
    joined = "".join(t["text"] for t in details["tokens"])
    assert joined.startswith(body["generated_text"])
    assert stop in joined[len(body["generated_text"]):]


def _tokens_of(http: httpx.Client, how: str, params: dict) -> list[dict]:
    body = {"inputs": PROMPT, "parameters": {**params, "details": True}}
    if how == "lmi":
        return _lmi(http, body)["details"]["tokens"]
    if how == "lmi_stream":
        return [line["token"] for line in _jsonlines(http, {**body, "stream": True})]
    return _lmi(http, body, "/generate")["details"]["tokens"]  # TGI


@pytest.mark.parametrize("how", ["lmi", "lmi_stream", "tgi"])
def test_stop_sequence_tokens_keep_their_own_text(http, native, how):
    """A Token's ``text`` is that token's text (seed: "the text representation of the token"),
    whether or not a stop sequence makes the engine hold text back."""
    free = native(PROMPT, 12)["text"]
    free_tokens = _tokens_of(http, how, {"max_new_tokens": 12})
    stopped = _tokens_of(http, how, {"max_new_tokens": 12, "stop": [_stop_word(free)]})
    assert [t["id"] for t in stopped] == [t["id"] for t in free_tokens[:len(stopped)]]
    # every token, the ones that matched the stop string included, keeps its own text
    assert [(t["id"], t["text"]) for t in stopped] == [
        (t["id"], t["text"]) for t in free_tokens[:len(stopped)]]


def test_eos_and_ignore_eos_token(http):
    natural = _lmi(http, {"inputs": EOS_PROMPT,
                          "parameters": {"max_new_tokens": 16, "details": True}})["details"]
    assert natural["finish_reason"] == "eos_token"
    assert natural["generated_tokens"] < 16
    assert natural["tokens"][-1].get("special_token") is True
    for key in ("ignore_eos_token", "ignore_eos"):
        body = _lmi(http, {"inputs": EOS_PROMPT,
                           "parameters": {"max_new_tokens": 16, "details": True, key: True}})
        details = body["details"]
        assert details["finish_reason"] == "length"
        assert details["generated_tokens"] == len(details["tokens"]) == 16
        _check_lmi_tokens(details["tokens"])
        assert _plain_text(details["tokens"]) == body["generated_text"]


@pytest.mark.parametrize(("params", "others"), [({"n": 3}, 2), ({"best_of": 2}, 1)])
def test_sampled_sequences_most_likely_first(http, params, others):
    body = _lmi(http, {"inputs": PROMPT, "parameters": {"do_sample": True, "max_new_tokens": 6,
                                                        "details": True, **params}})
    details = body["details"]
    best = _cumulative(details["tokens"])
    assert body["generated_text"] == _plain_text(details["tokens"])
    sequences = details["best_of_sequences"]
    assert len(sequences) == others
    for seq in sequences:
        assert set(seq) == {"generated_text", "finish_reason", "generated_tokens", "tokens"}
        assert seq["finish_reason"] in FINISH_REASONS
        assert seq["generated_tokens"] == len(seq["tokens"]) <= 6
        _check_lmi_tokens(seq["tokens"])
        assert seq["generated_text"] == _plain_text(seq["tokens"])
        assert best >= _cumulative(seq["tokens"])


def test_sampling_with_a_seed_is_reproducible(http):
    body = {"inputs": PROMPT, "parameters": {"do_sample": True, "seed": 42, "max_new_tokens": 8,
                                             "top_k": 50}}
    assert _lmi(http, body) == _lmi(http, body)


def test_tolerant_reader(http, native):
    expected = {"generated_text": native(PROMPT, 4)["text"]}
    for body in (
        {"inputs": PROMPT, "max_new_tokens": 4},  # knobs at the top level
        {"inputs": PROMPT, "parameters": {"max_tokens": 4}},  # alias
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "temperature": None,
                                          "stop_sequences": None, "no_such_knob": 1}},
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "stop": True}},  # TensorRT-LLM
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "do_sample": False,
                                          "temperature": 0.7}},  # do_sample false wins
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "do_sample": True,
                                          "temperature": 0}},  # temperature 0 is greedy
        {"inputs": PROMPT, "parameters": None, "max_new_tokens": 4},
    ):
        assert _lmi(http, body) == expected, body


def test_an_adapter_the_model_does_not_serve_is_a_404(http):
    """The session's model has no `lora` entry (tests/e2e/test_adapters_e2e.py serves some)."""
    response = http.post("/invocations", json={"inputs": PROMPT},
                         headers={"X-Amzn-SageMaker-Adapter-Identifier": "my-adapter"})
    assert response.status_code == 404, response.text
    assert response.json()["code"] == 404


def test_top_n_tokens_reports_alternatives(http):
    details = _lmi(http, {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "details": True,
                                                           "top_n_tokens": 2}})["details"]
    assert len(details["top_tokens"]) == len(details["tokens"]) == 3
    for token, top in zip(details["tokens"], details["top_tokens"], strict=True):
        assert len(top) == 2 and top[0]["id"] == token["id"]  # greedy: the best is chosen
        assert top[0]["log_prob"] >= top[1]["log_prob"]


@pytest.mark.parametrize("params", [{"n": 2, "do_sample": True}, {"best_of": 2, "do_sample": True}])
def test_several_sequences_cannot_stream(http, params):
    response = http.post("/invocations", json={"inputs": PROMPT, "stream": True,
                                               "parameters": {"max_new_tokens": 4, **params}})
    assert response.status_code == 424, response.text
    assert set(response.json()) == {"error", "code"} and response.json()["code"] == 424


# --- LMI dynamic batch ----------------------------------------------------------------------


DYNAMIC_INPUTS = ["Deep learning is", PROMPT, "My favourite colour is"]


def test_dynamic_batch_answers_in_input_order(http):
    params = {"max_new_tokens": 6}
    singles = [_lmi(http, {"inputs": text, "parameters": params})["generated_text"]
               for text in DYNAMIC_INPUTS]
    batch = _lmi(http, {"inputs": DYNAMIC_INPUTS, "parameters": params})
    assert batch == [{"generated_text": text} for text in singles]
    full = _lmi(http, {"inputs": DYNAMIC_INPUTS[:1],
                       "parameters": {**params, "return_full_text": True}})
    assert full == [{"generated_text": DYNAMIC_INPUTS[0] + singles[0]}]


def test_dynamic_batch_stream_is_jsonlines_outputs(http):
    params = {"max_new_tokens": 6}
    whole = _lmi(http, {"inputs": DYNAMIC_INPUTS, "parameters": params})
    lines = _jsonlines(http, {"inputs": DYNAMIC_INPUTS, "parameters": params, "stream": True})
    assert all(set(line) == {"outputs"} and len(line["outputs"]) == len(DYNAMIC_INPUTS)
               for line in lines)
    assert 1 <= len(lines) <= 6
    joined = ["".join(line["outputs"][i] for line in lines) for i in range(len(DYNAMIC_INPUTS))]
    assert joined == [item["generated_text"] for item in whole]


def test_dynamic_batch_stream_refuses_several_sequences_per_input(http):
    """``n`` only works without streaming (seed); a dynamic-batch stream has one text column per
    input, so it must refuse ``n`` > 1 like the rolling-batch stream does, not interleave the
    sampled sequences into one column."""
    response = http.post("/invocations", json={
        "inputs": [PROMPT], "stream": True,
        "parameters": {"max_new_tokens": 4, "n": 2, "do_sample": True}})
    assert response.status_code == 424, response.text
    assert response.json()["code"] == 424


def test_dynamic_batch_failure_is_424_and_aborts_the_started_inputs(http):
    before = engine_stats(http, MODEL)["aborted"]
    response = http.post("/invocations", json={
        "inputs": ["hello " * 3000, PROMPT],  # the first is beyond the context, the second runs
        "parameters": LONG})
    assert response.status_code == 424, response.text
    error = response.json()
    assert set(error) == {"code", "message", "error"}
    assert error["code"] == 424 and error["message"] == "invoke handler failure"
    assert "2048" in error["error"]
    stats = wait_for_abort(http, MODEL, before)
    assert stats["aborted"] == before + 1 and stats["active"] == 0


# --- LMI errors and the OpenAI bodies -------------------------------------------------------


@pytest.mark.parametrize("body", [
    {},
    {"parameters": {"max_new_tokens": 2}},
    {"inputs": ""},
    {"inputs": 5},
    {"inputs": [PROMPT, 3]},
    {"inputs": []},
    {"inputs": PROMPT, "parameters": "x"},
    {"inputs": PROMPT, "parameters": {"max_new_tokens": "x"}},
    {"inputs": PROMPT, "parameters": {"max_new_tokens": 0}},
    {"inputs": PROMPT, "parameters": {"max_new_tokens": 2.5}},
    {"inputs": PROMPT, "parameters": {"temperature": -1}},
    {"inputs": PROMPT, "parameters": {"top_p": 1.5}},
    {"inputs": PROMPT, "parameters": {"details": "yes"}},
    {"inputs": PROMPT, "parameters": {"stop_sequences": [1]}},
    {"inputs": PROMPT, "parameters": {"num_beams": 2}},
    {"inputs": PROMPT, "parameters": {"n": 2}},  # several sequences need sampling
    {"inputs": PROMPT, "stream": "yes"},
    ["not", "an", "object"],
])
def test_payload_errors_are_424(http, body):
    response = http.post("/invocations", json=body)
    assert response.status_code == 424, response.text
    error = response.json()
    # a list of inputs is a dynamic batch, whose failures carry the seed's dynamic-batch body
    dynamic = isinstance(body, dict) and isinstance(body.get("inputs"), list)
    expected = {"code", "message", "error"} if dynamic else {"error", "code"}
    assert set(error) == expected and error["code"] == 424 and error["error"]
    if dynamic:
        assert error["message"] == "invoke handler failure"


def test_missing_inputs_names_the_three_accepted_fields(http):
    error = http.post("/invocations", json={"parameters": {}}).json()
    assert error == {"code": 424, "error": "Input parsing failed: invalid payload. must contain "
                                           "prompt, inputs, or messages"}


def test_invalid_json_is_424(http):
    for path in ("/invocations", f"/predictions/{MODEL}"):
        response = http.post(path, content=b'{"inputs": ',
                             headers={"content-type": "application/json"})
        assert response.status_code == 424, response.text
        assert set(response.json()) == {"error", "code"} and response.json()["code"] == 424


@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusal_is_400_with_the_seed_error_body(http, stream):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 100000}, "stream": stream}
    response = http.post("/invocations", json=body)
    assert response.status_code == 400, response.text  # never a 200 stream
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()
    assert error == {**LMI_SEED_ERROR, "error": error["error"], "code": 400}
    assert "2048" in error["error"]


def test_prompt_body_is_an_openai_completion(http, native):
    body = _lmi(http, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == native(PROMPT, 4)["text"]
    assert body["usage"]["completion_tokens"] == 4
    with http.stream("POST", "/invocations", json={"prompt": PROMPT, "max_tokens": 4,
                                                   "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        raw = response.read().decode()
    assert raw.rstrip().endswith("data: [DONE]")  # OpenAI's framing, not LMI's
    chunks = [json.loads(f[len("data: "):]) for f in raw.strip().split("\n\n")[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == native(
        PROMPT, 4)["text"]


def test_messages_body_is_an_openai_chat_completion(http):
    body = _lmi(http, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                       "temperature": 0}, params={"model_name": MODEL})
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 4


# --- client disconnects abort the engine request --------------------------------------------


@pytest.mark.parametrize(("path", "body", "requests"), [
    ("/invocations", {"inputs": PROMPT, "stream": True, "parameters": LONG}, 1),
    ("/invocations", {"inputs": [PROMPT, "Deep learning is"], "stream": True,
                      "parameters": LONG}, 2),  # dynamic batch: one engine request per input
    # TGI has no ignore_eos; the tolerant reader takes LMI's spelling on TGI routes too
    ("/generate_stream", {"inputs": PROMPT, "parameters": LONG}, 1),
])
def test_stream_disconnect_aborts_the_engine_request(gateway_url, http, path, body, requests):
    before = engine_stats(http, MODEL)["aborted"]
    with httpx.Client(base_url=gateway_url, timeout=60) as client:
        drop_stream(client, path, body)
    stats = wait_for_abort(http, MODEL, before + requests - 1)
    assert stats["aborted"] == before + requests and stats["active"] == 0


def test_non_stream_disconnect_aborts_the_engine_request(gateway_url, http):
    before = engine_stats(http, MODEL)["aborted"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{gateway_url}/invocations", json={"inputs": PROMPT, "parameters": LONG},
                   timeout=2)
    stats = wait_for_abort(http, MODEL, before)
    assert stats["aborted"] == before + 1 and stats["active"] == 0


# --- TGI routes with the real clients -------------------------------------------------------


@pytest.fixture
def tgi_client(gateway_url) -> text_generation.Client:
    return text_generation.Client(gateway_url, timeout=60)


def test_text_generation_client_generate_with_decoder_input_details(tgi_client, native):
    expected = native(PROMPT, 8)
    response = tgi_client.generate(PROMPT, max_new_tokens=8, decoder_input_details=True)
    assert response.generated_text == expected["text"]
    details = response.details
    assert details.finish_reason == text_generation.types.FinishReason.Length
    assert details.generated_tokens == 8 and details.seed is None
    assert [t.id for t in details.tokens] == expected["token_ids"]
    assert all(t.special is False for t in details.tokens)
    assert "".join(t.text for t in details.tokens) == expected["text"]
    assert [t.id for t in details.prefill] == expected["prompt_token_ids"]
    assert details.prefill[0].logprob is None
    assert all(t.logprob is not None and t.logprob <= 0 for t in details.prefill[1:])


def test_text_generation_client_generate_stream(tgi_client, native):
    expected = native(PROMPT, 8)
    responses = list(tgi_client.generate_stream(PROMPT, max_new_tokens=8))
    assert len(responses) == 8
    assert all(r.generated_text is None and r.details is None for r in responses[:-1])
    last = responses[-1]
    assert last.generated_text == expected["text"]
    assert last.details.finish_reason == text_generation.types.FinishReason.Length
    assert last.details.generated_tokens == 8
    assert [r.token.id for r in responses] == expected["token_ids"]
    assert "".join(r.token.text for r in responses) == expected["text"]


def test_text_generation_client_best_of(tgi_client):
    response = tgi_client.generate(PROMPT, max_new_tokens=6, best_of=2, do_sample=True)
    others = response.details.best_of_sequences
    assert len(others) == 1
    best = sum(t.logprob for t in response.details.tokens)
    assert best >= sum(t.logprob for t in others[0].tokens)
    assert others[0].generated_text == "".join(t.text for t in others[0].tokens if not t.special)
    assert response.generated_text == "".join(
        t.text for t in response.details.tokens if not t.special)


def test_text_generation_client_sampling_seed_is_reported_and_reproducible(tgi_client):
    first = tgi_client.generate(PROMPT, max_new_tokens=6, do_sample=True, seed=7)
    second = tgi_client.generate(PROMPT, max_new_tokens=6, do_sample=True, seed=7)
    assert first.details.seed == 7
    assert first.generated_text == second.generated_text


@pytest.mark.parametrize("kwargs", [
    {"stop_sequences": ["a", "b", "c", "d", "e"]},  # the client has no limit; TGI allows 4
    {"max_new_tokens": 100000},  # beyond the context: refused by the engine
])
def test_server_side_422_is_a_client_validation_error(tgi_client, kwargs):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(TGIValidationError, match="Input validation error"):
        tgi_client.generate(PROMPT, **kwargs)
    with pytest.raises(TGIValidationError, match="Input validation error"):
        list(tgi_client.generate_stream(PROMPT, **kwargs))


@pytest.mark.parametrize(("route", "stream"), [
    ("/generate", False), ("/generate_stream", True), ("", False), ("", True)])
def test_inference_client_text_generation(gateway_url, native, route, stream):
    expected = native(PROMPT, 8)
    client = InferenceClient(model=f"{gateway_url}{route}", timeout=60)
    output = client.text_generation(PROMPT, details=True, stream=stream, max_new_tokens=8)
    if stream:
        outputs = list(output)
        assert len(outputs) == 8
        assert [o.token.id for o in outputs] == expected["token_ids"]
        assert isinstance(outputs[0].token.logprob, float)
        assert outputs[-1].generated_text == expected["text"]
        assert outputs[-1].details.finish_reason == "length"
        assert outputs[-1].details.generated_tokens == 8
        assert outputs[-1].details.input_length == len(expected["prompt_token_ids"])
        texts = list(client.text_generation(PROMPT, stream=True, max_new_tokens=8))
        assert "".join(texts) == expected["text"]
    else:
        assert output.generated_text == expected["text"]
        assert output.details.finish_reason == "length"
        assert output.details.generated_tokens == 8
        assert [t.id for t in output.details.tokens] == expected["token_ids"]
        assert client.text_generation(PROMPT, max_new_tokens=8) == expected["text"]


def test_generate_stream_raw_bytes(http, native):
    expected = native(PROMPT, 6)
    events = _sse(http, {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True}},
                  "/generate_stream", "data:")
    assert len(events) == 6
    assert all(set(e) == {"index", "token", "generated_text", "details"} for e in events)
    assert [e["index"] for e in events] == list(range(6))
    assert all(set(e["token"]) == TGI_TOKEN_KEYS for e in events)
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == expected["text"]
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 6, "seed": None,
                               "input_length": len(expected["prompt_token_ids"])}
    # as TGI: without `details` the last event carries the text and `details: null`
    plain = _sse(http, {"inputs": PROMPT, "parameters": {"max_new_tokens": 6}},
                 "/generate_stream", "data:")
    assert plain[-1]["generated_text"] == expected["text"] and plain[-1]["details"] is None


def test_generate_is_an_object_and_root_an_array_or_a_stream(http, native):
    expected = native(PROMPT, 4)["text"]
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    response = http.post("/generate", json=body)
    assert response.status_code == 200 and response.json() == {"generated_text": expected}
    assert response.headers["x-generated-tokens"] == "4"
    assert response.headers["x-prompt-tokens"] == str(len(native(PROMPT, 4)["prompt_token_ids"]))
    assert _lmi(http, {**body, "stream": False}, "/") == [{"generated_text": expected}]
    events = _sse(http, {**body, "stream": True}, "/", "data:")
    assert events[-1]["generated_text"] == expected
    full = _lmi(http, {"inputs": PROMPT, "parameters": {"max_new_tokens": 4,
                                                       "return_full_text": True}}, "/generate")
    assert full == {"generated_text": PROMPT + expected}


def test_tgi_truncate_keeps_the_last_prompt_tokens(http):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "truncate": 2, "details": True,
                                             "decoder_input_details": True}}
    details = _lmi(http, body, "/generate")["details"]
    assert len(details["prefill"]) == 2 and details["prefill"][0]["logprob"] is None
    events = _sse(http, body | {"parameters": {**body["parameters"],
                                               "decoder_input_details": False}},
                  "/generate_stream", "data:")
    assert events[-1]["details"]["input_length"] == 2


@pytest.mark.parametrize("body", [
    {"inputs": PROMPT, "parameters": {"top_p": 1.5}},
    {"inputs": PROMPT, "parameters": {"top_p": 1.0}},  # TGI: top_p in (0, 1)
    {"inputs": PROMPT, "parameters": {"temperature": 0}},
    {"inputs": PROMPT, "parameters": {"top_k": 0}},
    {"inputs": PROMPT, "parameters": {"best_of": 3, "do_sample": True}},
    {"inputs": PROMPT, "parameters": {"stop": ["a", "b", "c", "d", "e"]}},
    {"inputs": PROMPT, "parameters": {"max_new_tokens": 100000}},
    {"inputs": ""},
    {"parameters": {"max_new_tokens": 2}},
])
@pytest.mark.parametrize("route", ["/generate", "/generate_stream", "/"])
def test_tgi_validation_errors_are_422(http, body, route):
    response = http.post(route, json=body)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()
    assert set(error) == {"error", "error_type"} and error["error_type"] == "validation"


def test_tgi_invalid_json_is_422(http):
    response = http.post("/generate", content=b'{"inputs": ',
                         headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation"


def test_tgi_info(http):
    info = http.get("/info").json()
    max_model_len = http.get(f"/v1/models/{MODEL}").json()["max_model_len"]
    assert info["model_id"] == MODEL
    assert info["max_total_tokens"] == max_model_len
    assert info["max_input_tokens"] == max_model_len - 1
    assert info["max_best_of"] == 2 and info["max_stop_sequences"] == 4
    assert isinstance(info["version"], str) and isinstance(info["max_concurrent_requests"], int)
    assert http.get("/").status_code == 200  # POST / is TGI; GET / still describes the gateway


# --- LMI's TGI-compatible mode (a second app in this process) -------------------------------


def test_compat_non_stream_is_a_one_element_array_with_details(compat_url, native):
    expected = native(PROMPT, 8)
    response = httpx.post(f"{compat_url}/invocations", timeout=60,
                          json={"inputs": PROMPT, "parameters": {"max_new_tokens": 8}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body, list) and len(body) == 1
    [item] = body
    assert set(item) == {"generated_text", "details"}  # details on by default
    assert item["generated_text"] == expected["text"]
    details = item["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 8
    assert details["inputs"] == PROMPT and details["prefill"] == []
    assert all(set(t) == TGI_TOKEN_KEYS and t["special"] is False for t in details["tokens"])
    assert [t["id"] for t in details["tokens"]] == expected["token_ids"]
    plain = httpx.post(f"{compat_url}/invocations", timeout=60, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": 8, "details": False}}).json()
    assert plain == [{"generated_text": expected["text"]}]


def test_compat_stream_is_sse_with_tgi_tokens(compat_url, native):
    expected = native(PROMPT, 8)
    with httpx.Client(base_url=compat_url, timeout=60) as client:
        # LMI's SSE writer puts a space after "data:", TGI's does not: either is SSE
        events = _sse(client, {"inputs": PROMPT, "parameters": {"max_new_tokens": 8},
                               "stream": True}, "/invocations", "data: ")
    assert len(events) == 8
    assert all(set(e["token"]) == TGI_TOKEN_KEYS for e in events)
    assert [e["token"]["id"] for e in events] == expected["token_ids"]
    assert all(e["generated_text"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == expected["text"]
    assert events[-1]["details"]["finish_reason"] == "length"
    assert events[-1]["details"]["generated_tokens"] == 8


@pytest.mark.parametrize("stream", [False, True])
def test_compat_inference_client_on_invocations(compat_url, native, stream):
    expected = native(PROMPT, 8)
    client = InferenceClient(model=f"{compat_url}/invocations", timeout=60)
    output = client.text_generation(PROMPT, details=True, stream=stream, max_new_tokens=8)
    if stream:
        outputs = list(output)
        assert all(isinstance(o.token.id, int) and isinstance(o.token.logprob, float)
                   for o in outputs)
        assert outputs[-1].generated_text == expected["text"]
        assert outputs[-1].details.finish_reason == "length"
        assert outputs[-1].details.generated_tokens == 8
    else:
        assert output.generated_text == expected["text"]
        assert output.details.generated_tokens == 8
        assert all(isinstance(t.logprob, float) for t in output.details.tokens)


def test_compat_strict_text_generation_client_on_invocations(compat_url, native):
    expected = native(PROMPT, 8)
    client = text_generation.Client(f"{compat_url}/invocations", timeout=60)
    response = client.generate(PROMPT, max_new_tokens=8, decoder_input_details=True)
    assert response.generated_text == expected["text"]
    assert [t.id for t in response.details.prefill] == expected["prompt_token_ids"]
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=8))
    assert streamed[-1].generated_text == expected["text"]
    assert [r.token.id for r in streamed] == expected["token_ids"]


def test_compat_engine_refusal_is_not_a_200(compat_url):
    for stream in (False, True):
        response = httpx.post(f"{compat_url}/invocations", timeout=60, json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 100000}, "stream": stream})
        assert response.status_code == 400, response.text
        assert response.json()["details"]["finish_reason"] == "error"


# --- several models, LMI's output_formatter=sse, tgi_model ----------------------------------


def test_two_models_need_a_model_name(two_model_url, native):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    with httpx.Client(base_url=two_model_url, timeout=60) as client:
        response = client.post("/invocations", json=body)
        assert response.status_code == 400, response.text
        error = response.json()
        assert set(error) == {"code", "type", "message"} and error["code"] == 400
        assert "model_name" in error["message"]
        expected = {"generated_text": native(PROMPT, 4)["text"]}
        assert _lmi(client, body, params={"model_name": "second"}) == expected
        assert _lmi(client, body, "/predictions/second") == expected
        assert [m["modelName"] for m in client.get("/models").json()["models"]] == [MODEL,
                                                                                   "second"]
        assert client.get("/ping").json() == {MODEL: "Healthy", "second": "Healthy"}
        assert client.get("/info").json()["model_id"] == "second"  # tgi_model
        assert _lmi(client, body, "/generate") == expected


def test_output_formatter_sse_is_the_stream_default(two_model_url):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True},
            "stream": True, "model_name": MODEL}
    with httpx.Client(base_url=two_model_url, timeout=60) as client:
        events = _sse(client, body, "/invocations", "data: ")
        lines = _jsonlines(client, body, headers={"Accept": "application/jsonlines"})
    assert events == lines
    assert set(events[-1]) == {"token", "generated_text", "details"}
    assert all(set(e["token"]) == LMI_TOKEN_KEYS for e in events)

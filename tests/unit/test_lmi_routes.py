"""LMI and TGI routes in process (httpx.ASGITransport over the fake engine)."""

import json

import httpx
import pytest

from contract import TokenPrompt
from engines.kit.config import ModelConfig
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from tests.fake_engine import FakeEngine
from tests.seed_examples import LMI_SEED_ERROR

BODY = {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "details": True}}


def _client(engines=None, **config):
    engines = engines or {"fake-model": FakeEngine()}
    app = create_app(ModelRegistry(engines), GatewayConfig(**config))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


def _lines(response: httpx.Response) -> list[dict]:
    assert response.text.endswith("\n")
    return [json.loads(line) for line in response.text.splitlines()]


def _sse(response: httpx.Response, prefix: str) -> list[dict]:
    frames = response.text.split("\n\n")
    assert frames[-1] == "" and all(f.startswith(prefix + "{") for f in frames[:-1]), response.text
    return [json.loads(f[len(prefix):]) for f in frames[:-1]]


async def test_invocations_rolling_batch_json(client):
    r = await client.post("/invocations", json=BODY)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["generated_text"] == "Hel"
    assert body["details"]["tokens"][0] == {"id": ord("H"), "text": "H", "log_prob": -0.1}


async def test_invocations_jsonlines_stream(client):
    r = await client.post("/invocations", json={**BODY, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"] == "application/jsonlines"
    assert r.headers["cache-control"] == "no-cache"
    lines = _lines(r)
    assert [line["token"]["text"] for line in lines] == ["H", "e", "l"]
    assert "generated_text" not in lines[0] and lines[-1]["generated_text"] == "Hel"
    assert "tokens" not in lines[-1]["details"]


async def test_sse_by_accept_header_or_config(client):
    r = await client.post("/invocations", json={**BODY, "stream": True},
                          headers={"accept": "text/event-stream"})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert _sse(r, "data: ")[-1]["generated_text"] == "Hel"
    async with _client(lmi_output_formatter="sse") as sse_client:
        r = await sse_client.post("/invocations", json={**BODY, "stream": True})
        assert _sse(r, "data: ")[-1]["generated_text"] == "Hel"
        r = await sse_client.post("/invocations", json={**BODY, "stream": True},
                                  headers={"accept": "application/jsonlines"})
        assert _lines(r)[-1]["generated_text"] == "Hel"


async def test_model_selection():
    engines = {"a": FakeEngine("a", reply="aaa"), "b": FakeEngine("b", reply="bbb")}
    async with _client(engines) as c:
        r = await c.post("/invocations", json=BODY)
        assert r.status_code == 400 and r.json() == {
            "code": 400, "type": "BadRequestException",
            "message": "Parameter model_name is required."}
        assert (await c.post("/invocations?model_name=b", json=BODY)).json()[
            "generated_text"] == "bbb"
        assert (await c.post("/invocations", json=BODY, headers={"model_name": "b"})).json()[
            "generated_text"] == "bbb"
        assert (await c.post("/invocations", json={**BODY, "model_name": "a"})).json()[
            "generated_text"] == "aaa"
        for path in ("/predictions/b", "/predictions/b/1", "/models/b/invoke"):
            assert (await c.post(path, json=BODY)).json()["generated_text"] == "bbb"
        r = await c.post("/predictions/nope", json=BODY)
        assert r.status_code == 404 and r.json() == {
            "code": 404, "type": "ModelNotFoundException", "message": "Model not found: nope"}
        models = (await c.get("/models")).json()["models"]
        assert [m["modelName"] for m in models] == ["a", "b"]


@pytest.mark.parametrize("body, fragment", [
    ({"parameters": {}}, "must contain prompt, inputs, or messages"),
    ([1, 2], "must contain prompt, inputs, or messages"),
    ({"inputs": "x", "parameters": {"max_new_tokens": "x"}}, "max_new_tokens"),
    ({"inputs": "x", "parameters": {"temperature": -1}}, "temperature"),
    ({"inputs": 5}, "inputs"),
])
async def test_payload_errors_are_424(client, body, fragment):
    r = await client.post("/invocations", json=body)
    assert r.status_code == 424
    assert set(r.json()) == {"error", "code"} and r.json()["code"] == 424
    assert fragment in r.json()["error"]


async def test_invalid_json_is_424_and_an_adapter_the_model_lacks_404(client):
    r = await client.post("/invocations", content=b"{nope")
    assert r.status_code == 424 and "invalid JSON" in r.json()["error"]
    r = await client.post("/invocations", json=BODY,
                          headers={"X-Amzn-SageMaker-Adapter-Identifier": "lora"})
    assert r.status_code == 404 and r.json()["type"] == "ModelNotFoundException"
    assert "has no adapter `lora`" in r.json()["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_refusal_is_the_seed_error_body(client, stream):
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 1000}, "stream": stream}
    r = await client.post("/invocations", json=body)
    assert r.status_code == 400  # never a 200 stream: the first event was peeked
    assert r.json() == {**LMI_SEED_ERROR, "code": 400, "error": (
        "this model's maximum context length is 64 tokens; the prompt has 2 and 1000 were "
        "requested for the completion")}


async def test_top_n_tokens_beyond_the_engine_is_refused_by_admission(client):
    # LMI's wire format has no bound of its own: the engine's capability decides (the fake's 20)
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "top_n_tokens": 21,
                                           "details": True}}
    r = await client.post("/invocations", json=body)
    assert r.status_code == 400
    assert r.json() == {**LMI_SEED_ERROR, "error": "logprobs must be in [0, 20]", "code": 400}
    body["parameters"]["top_n_tokens"] = 20
    r = await client.post("/invocations", json=body)
    assert r.status_code == 200 and len(r.json()["details"]["top_tokens"]) == 2


async def test_openai_bodies_dispatch(client):
    r = await client.post("/invocations", json={"prompt": "Hi", "max_tokens": 2})
    assert r.json()["object"] == "text_completion" and r.json()["choices"][0]["text"] == "He"
    r = await client.post("/invocations", json={"messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 2})
    assert r.json()["object"] == "chat.completion"


async def test_dynamic_batch(client):
    r = await client.post("/invocations", json={"inputs": ["a", "b"],
                                                "parameters": {"max_new_tokens": 2}})
    assert r.json() == [{"generated_text": "He"}, {"generated_text": "He"}]
    r = await client.post("/invocations", json={"inputs": ["a", "b"], "stream": True,
                                                "parameters": {"max_new_tokens": 2}})
    assert r.headers["content-type"] == "application/jsonlines"
    assert _lines(r) == [{"outputs": ["H", "H"]}, {"outputs": ["e", "e"]}]


async def test_dynamic_batch_failure_is_424(client):
    r = await client.post("/invocations", json={"inputs": ["a", "b" * 70]})
    assert r.status_code == 424
    assert r.json() == {"code": 424, "message": "invoke handler failure",
                        "error": "prompt has 70 tokens; this model's maximum context length is 64 "
                                 "tokens including at least one generated token"}


async def test_tgi_compat_mode_on_invocations():
    async with _client(lmi_tgi_compat=True) as c:
        r = await c.post("/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
        body = r.json()
        assert isinstance(body, list) and len(body) == 1
        assert body[0]["details"]["tokens"][0] == {"id": 72, "text": "H", "logprob": -0.1,
                                                   "special": False}
        assert body[0]["details"]["inputs"] == "Hi" and body[0]["details"]["prefill"] == []
        r = await c.post("/invocations", json={**BODY, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r, "data: ")  # the seed's TGI-compat example: `data: ` with a space
        assert events[-1]["generated_text"] == "Hel" and events[0]["token"]["special"] is False
        r = await c.post("/invocations", json={**BODY, "stream": True},
                         headers={"accept": "application/jsonlines"})
        assert _lines(r)[-1]["generated_text"] == "Hel"  # SSE is only the default there


async def test_truncate_keeps_the_last_tokens(client, engine):
    await client.post("/invocations", json={"inputs": "abcdef",
                                            "parameters": {"truncate": 2, "max_new_tokens": 1}})
    assert engine.requests[-1].prompt == TokenPrompt(token_ids=(ord("e"), ord("f")))


async def test_ping_is_a_status_map(client):
    r = await client.get("/ping")
    assert r.status_code == 200 and r.json() == {"fake-model": "Healthy"}


async def test_ping_reports_unhealthy_models_with_500():
    class Sick(FakeEngine):
        async def check_health(self):
            raise RuntimeError("dead")

    async with _client({"ok": FakeEngine("ok"), "sick": Sick("sick")}) as c:
        r = await c.get("/ping")
        assert r.status_code == 500 and r.json() == {"ok": "Healthy", "sick": "Unhealthy"}


async def test_api_key_guards_invocations_not_ping():
    async with _client(api_key="k") as c:
        assert (await c.post("/invocations", json=BODY)).status_code == 401
        assert (await c.get("/ping")).status_code == 200
        r = await c.post("/invocations", json=BODY, headers={"authorization": "Bearer k"})
        assert r.status_code == 200


# --- TGI ------------------------------------------------------------------------------------


async def test_tgi_generate_is_an_object_with_timing_headers(client):
    r = await client.post("/generate", json=BODY)
    body = r.json()
    assert body["generated_text"] == "Hel" and set(body["details"]) == {
        "finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
    assert r.headers["x-generated-tokens"] == "3" and r.headers["x-prompt-tokens"] == "2"
    assert int(r.headers["x-total-time"]) >= 0
    r = await client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert r.json() == {"generated_text": "He"}  # TGI: details only when asked


async def test_tgi_root_route_list_or_stream(client):
    r = await client.post("/", json=BODY)
    assert isinstance(r.json(), list) and r.json()[0]["generated_text"] == "Hel"
    r = await client.post("/", json={**BODY, "stream": True})
    events = _sse(r, "data:")
    assert [e["index"] for e in events] == [0, 1, 2]
    assert events[-1]["details"]["input_length"] == 2


async def test_tgi_stream_details_only_when_asked(client):
    r = await client.post("/generate_stream", json={"inputs": "Hi",
                                                    "parameters": {"max_new_tokens": 2}})
    events = _sse(r, "data:")
    assert events[0]["details"] is None and events[0]["generated_text"] is None
    assert events[-1]["generated_text"] == "He" and events[-1]["details"] is None
    r = await client.post("/generate_stream", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 2, "details": True}})
    assert _sse(r, "data:")[-1]["details"]["finish_reason"] == "length"


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
async def test_tgi_errors(client, path):
    r = await client.post(path, json={"inputs": "Hi", "parameters": {"top_p": 1.5}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert set(r.json()) == {"error", "error_type"} and "top_p" in r.json()["error"]
    r = await client.post(path, json={"inputs": "Hi", "parameters": {"max_new_tokens": 1000}})
    assert r.status_code == 422 and "maximum context length is 64" in r.json()["error"]
    r = await client.post(path, content=b"not json")
    assert r.status_code == 422


async def test_tgi_best_of_not_on_streams(client):
    r = await client.post("/generate_stream", json={"inputs": "Hi", "parameters": {
        "best_of": 2, "do_sample": True}})
    assert r.status_code == 422 and "streaming" in r.json()["error"]


async def test_tgi_model_and_info():
    engines = {"a": FakeEngine("a", reply="aaa"), "b": FakeEngine("b", reply="bbb")}
    models = [ModelConfig(name="a"), ModelConfig(name="b")]
    async with _client(engines, models=models, tgi_model="b") as c:
        assert (await c.post("/generate", json=BODY)).json()["generated_text"] == "bbb"
        info = (await c.get("/info")).json()
        assert info["model_id"] == "b" and info["max_stop_sequences"] == 4
    async with _client(engines) as c:  # default: the first model
        assert (await c.post("/generate", json=BODY)).json()["generated_text"] == "aaa"


def test_tgi_model_must_be_served():
    with pytest.raises(ValueError, match="tgi_model"):
        GatewayConfig(tgi_model="nope")


async def test_get_root_still_describes_the_gateway(client):
    r = await client.get("/")
    assert r.status_code == 200 and "tgi" in r.json()["protocols"]


@pytest.mark.parametrize("name", [["a"], {"x": 1}, 3])
async def test_non_string_model_name_is_400(client, name):
    r = await client.post("/invocations", json={**BODY, "model_name": name})
    assert r.status_code == 400 and r.json()["type"] == "BadRequestException"


async def test_decoder_input_details_turns_details_on(client):
    r = await client.post("/generate", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 1, "decoder_input_details": True}})
    assert [t["id"] for t in r.json()["details"]["prefill"]] == [ord("H"), ord("i")]


async def test_dynamic_batch_parameter_errors_use_the_dynamic_shape(client):
    r = await client.post("/invocations", json={"inputs": ["a"], "parameters": {"top_k": 1.5}})
    assert r.status_code == 424 and r.json()["message"] == "invoke handler failure"


class _FailsLater(FakeEngine):
    """Prompts starting with "bad" fail after two tokens; others run slowly."""

    async def generate(self, request):
        bad = request.prompt.text.startswith("bad")
        count = 0
        async for event in super().generate(request):
            yield event
            count += 1
            if bad and count == 2:
                from contract import ErrorEvent
                yield ErrorEvent(kind="engine", message="replica failed")
                return


@pytest.mark.parametrize("stream", [False, True])
async def test_dynamic_batch_failure_aborts_the_other_inputs(stream):
    engine = _FailsLater(delay=0.01)
    async with _client({"fake-model": engine}) as c:
        body = {"inputs": ["good", "bad"], "stream": stream,
                "parameters": {"max_new_tokens": 50, "ignore_eos": True}}
        r = await c.post("/invocations", json=body)
        if stream:
            assert r.status_code == 200
            assert _lines(r)[-1] == {"code": 424, "message": "invoke handler failure",
                                     "error": "replica failed"}
        else:
            assert r.status_code == 424 and r.json()["error"] == "replica failed"
    # "good" was aborted, not run to its 50 tokens ("bad" closes its own inner stream too)
    assert set(engine.cancelled) == {r.request_id for r in engine.requests}
    assert not engine.active


async def test_a_stream_that_stops_short_ends_with_an_error():
    class Truncated(FakeEngine):
        async def generate(self, request):
            async for event in super().generate(request):
                yield event
                return  # one token, then nothing: no final event

    async with _client({"fake-model": Truncated()}) as c:
        lines = _lines(await c.post("/invocations", json={**BODY, "stream": True}))
        assert lines[-1]["details"]["finish_reason"] == "error"
        events = _sse(await c.post("/generate_stream", json=BODY), "data:")
        assert events[-1] == {"error": "incomplete generation",
                              "error_type": "incomplete_generation"}


async def test_route_errors_in_each_protocols_shape(client):
    r = await client.get("/invocations")
    assert r.status_code == 405 and r.json()["type"] == "MethodNotAllowedException"
    assert set(r.json()) == {"code", "type", "message"}
    r = await client.get("/generate")
    assert r.status_code == 405 and set(r.json()) == {"error", "error_type"}
    r = await client.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json() and "message" in r.json()["error"]


async def test_fanout_beyond_max_fanout_is_refused_before_any_engine_request():
    """Issue 15: an inputs list of 2,000 started 2,000 engine requests. Now inputs x n above
    GatewayConfig.max_fanout is refused in LMI's dynamic-batch shape; OpenAI-shaped bodies on
    /invocations get OpenAI's 400 naming the field."""
    engine = FakeEngine()
    async with _client({"fake-model": engine}, max_fanout=4) as c:
        r = await c.post("/invocations", json={"inputs": ["a"] * 5,
                                               "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 424 and "at most 4" in r.json()["error"]
        r = await c.post("/invocations", json={"inputs": ["a", "b"], "parameters": {
            "max_new_tokens": 2, "do_sample": True, "n": 3}})
        assert r.status_code == 424 and "2 inputs x 3 sequences" in r.json()["error"]
        assert engine.requests == []
        r = await c.post("/invocations", json={"prompt": ["a"] * 5, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        ok = await c.post("/invocations", json={"inputs": ["a"] * 4,
                                                "parameters": {"max_new_tokens": 2}})
        assert ok.status_code == 200 and len(ok.json()) == 4

"""MindIE / Triton generate: validation rows, mapping, encoders, routes (fake engine)."""

import json

import pytest

from contract import FinalEvent, TokenEvent, Usage
from protocols.errors import EnvelopeError
from protocols.mindie.encode import ResponseMeta, collect_response, sse, stream_events
from protocols.mindie.validate import to_request
from tests.seed_examples import MINDIE_SEED_EXAMPLE
from tests.streams import _aiter

VOCAB = 1000

SEED_EXAMPLE = MINDIE_SEED_EXAMPLE  # verbatim (the model name is in the URL)


def _req(body):
    return to_request(body, "m", VOCAB, "fallback")


def _params(**params):
    return _req({"text_input": "hi", "parameters": params})[0]


def test_seed_example_maps_every_field():
    request, options = _req(SEED_EXAMPLE)
    s = request.sampling
    assert options.id == "a123" and options.details
    assert (s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.seed, s.max_tokens) == (
        1.0, 10, 0.99, 1.1, 123, 20)
    assert request.priority == 5 and request.timeout_s == 10


def test_defaults():
    request, options = _req({"text_input": "hi"})
    assert request.sampling.max_tokens == 20 and request.sampling.temperature == 0  # greedy
    assert request.priority == 5 and request.timeout_s == 600
    assert not options.details and options.id == "fallback"


@pytest.mark.parametrize("value", ["a b", "", "x" * 257, 12, None, "é"])
def test_bad_ids_are_422(value):
    with pytest.raises(EnvelopeError) as info:
        _req({"id": value, "text_input": "hi"})
    assert info.value.status == 422 and info.value.error_type == "Input Validation Error"


def test_good_id():
    assert _req({"id": "A_z-09", "text_input": "hi"})[1].id == "A_z-09"
    assert _req({"id": "x" * 256, "text_input": "hi"})[1].id == "x" * 256


@pytest.mark.parametrize("text", [None, "", 5, ["a", "b"], [{"type": "text", "text": "a"}],
                                  "x" * (4 * 1024 * 1024 + 1)])
def test_bad_text_input_is_422(text):
    body = {} if text is None else {"text_input": text}
    with pytest.raises(EnvelopeError) as info:
        _req(body)
    assert info.value.status == 422


def test_single_string_list_is_accepted_as_text():
    assert _req({"text_input": ["hello"]})[0].prompt.text == "hello"


@pytest.mark.parametrize(("name", "value"), [
    ("details", 1), ("do_sample", "yes"), ("watermark", 0), ("perf_stat", "false"),
    ("max_new_tokens", 0), ("max_new_tokens", 2**31), ("max_new_tokens", 2.5),
    ("max_new_tokens", -1), ("repetition_penalty", 0), ("repetition_penalty", -1),
    ("seed", -1), ("seed", 2**64), ("seed", 1.5), ("temperature", 0), ("temperature", -0.5),
    ("top_k", -1), ("top_k", 2**31), ("top_p", 0), ("top_p", 1.5), ("batch_size", 0),
    ("batch_size", 2**31), ("typical_p", 0), ("typical_p", 1.01), ("priority", 0),
    ("priority", 6), ("priority", 2.0), ("timeout", 0), ("timeout", 3601), ("timeout", 1.5),
])
def test_out_of_range_parameters_are_422_naming_the_field(name, value):
    with pytest.raises(EnvelopeError) as info:
        _params(**{name: value})
    assert info.value.status == 422 and name in info.value.message


@pytest.mark.parametrize(("name", "value"), [
    ("max_new_tokens", 2**31 - 1), ("max_new_tokens", 1), ("repetition_penalty", 0.01),
    ("seed", 2**64 - 1), ("seed", 0), ("temperature", 0.001), ("temperature", 5),
    ("top_k", 0), ("top_k", 2**31 - 1), ("top_p", 1), ("top_p", 0.01), ("batch_size", 1),
    ("typical_p", 1.0), ("priority", 1), ("priority", 5), ("timeout", 1), ("timeout", 3600),
])
def test_boundary_values_are_accepted(name, value):
    _params(**{name: value})


def test_sampling_rules():
    assert _params(do_sample=False, temperature=0.7).sampling.temperature == 0
    assert _params(do_sample=True).sampling.temperature == 1.0
    assert _params(top_p=0.9).sampling.temperature == 1.0  # a sampling knob implies sampling
    assert _params(top_k=VOCAB).sampling.top_k == 0  # >= vocab size: off
    assert _params(seed=2**64 - 1).sampling.seed < 2**63  # folded into the engine's range
    assert _params(priority=1).priority == 1


def test_triton_top_level_knobs():
    request, _ = _req({"text_input": "hi", "temperature": 0, "max_tokens": 7, "stream": True,
                       "top_p": 1.0, "min_length": 7, "end_id": 10**6,
                       "parameters": {"stop_words": [""], "bad_words": [""]}})
    s = request.sampling
    assert s.temperature == 0 and s.max_tokens == 7 and s.min_tokens == 7 and s.ignore_eos
    assert s.stop == ()
    lite = _req({"text_input": "hi", "parameters": {"max_tokens": 3, "stop_words": ["\n"]}})[0]
    assert lite.sampling.max_tokens == 3 and lite.sampling.stop == ("\n",)
    both = _req({"text_input": "hi", "max_tokens": 3, "parameters": {"max_new_tokens": 5}})[0]
    assert both.sampling.max_tokens == 5  # parameters win


def test_parameters_must_be_an_object():
    with pytest.raises(EnvelopeError):
        _req({"text_input": "hi", "parameters": [1]})
    with pytest.raises(EnvelopeError):
        _req([1, 2])


def _tok(text, step, last=False, queue=None, batch=3):
    return TokenEvent(token_id=step, text=text, elapsed_s=0.1 + 0.02 * step, batch_size=batch,
                      queue_s=queue, last=last)


def _final(reason="eos"):
    return FinalEvent(finish_reason=reason, usage=Usage(prompt_tokens=2, completion_tokens=3))


EVENTS = [_tok(" Pa", 0, queue=0.000035), _tok("", 1), _tok("ris", 2), _tok(".", 3, last=True),
          _final("eos")]


async def test_stream_events_shape_and_timing():
    meta = ResponseMeta(id="a123", model="m", details=True)
    out = [e async for e in stream_events(_aiter(EVENTS), meta)]
    assert [e["text_output"] for e in out] == [" Pa", "ris", "."]  # empty increment merged
    assert list(out[0]) == ["id", "model_name", "model_version", "text_output", "details",
                            "prefill_time", "decode_time"]
    assert out[0]["prefill_time"] == pytest.approx(100) and out[0]["decode_time"] is None
    assert out[1]["prefill_time"] is None and out[1]["decode_time"] == pytest.approx(40)
    assert [e["details"]["generated_tokens"] for e in out] == [1, 3, 4]
    assert out[0]["details"]["queue_wait_time"] == 35 and out[1]["details"]["queue_wait_time"] == 0
    assert [("finish_reason" in e["details"]) for e in out] == [False, False, True]
    assert out[-1]["details"]["finish_reason"] == "eos_token"
    assert out[0]["details"]["batch_size"] == 3 and out[0]["model_version"] is None
    assert out[0]["details"]["first_token_cost"] is None


async def test_stream_without_details_has_no_details_or_timing():
    out = [e async for e in stream_events(_aiter(EVENTS), ResponseMeta("a", "m", False))]
    assert all(set(e) == {"id", "model_name", "model_version", "text_output"} for e in out)


async def test_full_text_mode_is_cumulative():
    out = [e async for e in stream_events(_aiter(EVENTS), ResponseMeta("a", "m", True, True))]
    assert [e["text_output"] for e in out] == [" Pa", " Paris", " Paris."]


async def test_sse_framing_has_no_space_and_no_done():
    frames = [f async for f in sse(_aiter([{"a": 1}, {"b": 2}]))]
    # Compact, as MindIE's own server writes its events (`data:{"id":...}`).
    assert frames == [b'data:{"a":1}\n\n', b'data:{"b":2}\n\n']


async def test_collect_response():
    body = await collect_response(_aiter(EVENTS), ResponseMeta("a123", "m", True))
    assert body["text_output"] == " Paris." and body["model_version"] is None
    d = body["details"]
    assert d["finish_reason"] == "eos_token" and d["generated_tokens"] == 4
    assert d["batch_size"] == [3, 3, 3, 3] and d["queue_wait_time"] == [35, 0, 0, 0]
    plain = await collect_response(_aiter(EVENTS), ResponseMeta("a", "m", False))
    assert "details" not in plain and "finish_reason" not in json.dumps(plain)


@pytest.mark.parametrize(("reason", "expected"), [("length", "length"),
                                                   ("stop_sequence", "stop_sequence"),
                                                   ("abort", "stop_sequence")])
async def test_finish_reasons(reason, expected):
    events = [_tok("a", 0, last=True), _final(reason)]
    out = [e async for e in stream_events(_aiter(events), ResponseMeta("a", "m", True))]
    assert out[-1]["details"]["finish_reason"] == expected


# --- routes over the fake engine ------------------------------------------------------------


def _frames(text: str) -> list[dict]:
    assert text.endswith("\n\n")
    frames = text[:-2].split("\n\n")
    assert all(f.startswith("data:{") for f in frames)
    return [json.loads(f[len("data:"):]) for f in frames]


async def test_route_seed_example_streams(client):
    r = await client.post("/v2/models/fake-model/generate_stream", json=SEED_EXAMPLE)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _frames(r.text)
    assert all(e["id"] == "a123" and e["model_name"] == "fake-model" for e in events)
    assert events[-1]["details"]["finish_reason"] in ("eos_token", "length")


async def test_route_generate_non_stream(client):
    r = await client.post("/v2/models/fake-model/generate",
                          json={"text_input": "Hi", "parameters": {"max_new_tokens": 5,
                                                                   "details": True}})
    body = r.json()
    assert body["text_output"] == "Hello" and body["details"]["generated_tokens"] == 5
    assert body["details"]["finish_reason"] == "length"


async def test_route_errors(client):
    r = await client.post("/v2/models/nope/generate", json={"text_input": "x"})
    assert r.status_code == 404 and r.json() == {"error": "Model nope not found.",
                                                 "error_type": "NotFoundError"}
    r = await client.post("/v2/models/fake-model/generate_stream", content=b"{bad",
                          headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    r = await client.post("/v2/models/fake-model/generate_stream",
                          json={"text_input": "x", "parameters": {"top_p": 0}})
    assert r.status_code == 422 and "top_p" in r.json()["error"]
    r = await client.post("/v2/models/fake-model/generate_stream",
                          json={"text_input": "x", "parameters": {"max_new_tokens": 500}})
    assert r.status_code == 422  # the engine refused it before the first token
    r = await client.post("/v2/models/fake-model/versions/1/generate", json={"text_input": "x"})
    assert r.status_code == 404 and "versions" in r.json()["error"]


async def test_route_probes(client):
    assert (await client.get("/v2/health/live")).status_code == 200
    assert (await client.get("/v2/health/ready")).status_code == 200
    assert (await client.get("/v2/models/fake-model/ready")).status_code == 200
    assert (await client.get("/v2/models/nope/ready")).status_code == 404
    meta = (await client.get("/v2/models/fake-model")).json()
    assert meta["inputs"][0]["name"] == "text_input"
    assert "generate" in (await client.get("/v2")).json()["extensions"]


async def test_aliases_resolve_for_hard_coded_model_names(engine):
    import httpx

    from gateway.config import GatewayConfig
    from gateway.ingress.asgi import create_app
    from gateway.ingress.registry import ModelRegistry

    app = create_app(ModelRegistry({"fake-model": engine}, {"ensemble": "fake-model"}),
                     GatewayConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as c:
        r = await c.post("/v2/models/ensemble/generate_stream",
                         json={"text_input": "Hi", "max_tokens": 3, "temperature": 0.000001})
        assert r.status_code == 200 and _frames(r.text)[-1]["model_name"] == "ensemble"
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["fake-model"]
    with pytest.raises(ValueError):
        ModelRegistry({"fake-model": engine}, {"x": "missing"})
    with pytest.raises(ValueError):
        GatewayConfig(aliases={"x": "missing"})

"""LoRA adapters end to end (docs/adapters.md): a tiny random Llama on two vLLM replicas in its
own application, 8 random rank-8 adapters made with ``peft`` in its adapter directory, at most
2 of them loaded per replica; a gateway application naming the model reaches the replicas over
the engine channel. Each protocol's real client names an adapter its own way.

Oracles: vLLM's own greedy output for that adapter (``reference_greedy`` with the adapter: a
``LoRARequest`` of vLLM's API, no gateway code), and the base model's without one."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import msgspec
import pytest

from contract import Adapter
from engines.kit.config import Lora, ModelConfig
from engines.kit.embedded import local_model_dir
from gateway.config import GatewayConfig
from gateway.model_routes import model_route
from tests.e2e.conftest import MODEL
from tests.lora_adapters import save_random_adapter
from tests.pipeline_models import build_tiny
from tests.serve_session import VLLM_TEST_ARGS, _wait_healthy

pytestmark = pytest.mark.e2e

LORA_MODEL, APP, GATEWAY_APP, ROUTE = "tiny-lora", "lora", "lora-gateway", "/lora-gw"
ADAPTERS = [f"a{i}" for i in range(8)]
PROMPT = "The weather today in the old harbour town"
MAX_TOKENS = 12
ENGINE_ARGS = {**VLLM_TEST_ARGS, "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}


@pytest.fixture(scope="module")
def lora_setup(gateway_url, tmp_path_factory):
    from ray import serve

    from gateway.app import build_app, build_model_app

    root = tmp_path_factory.mktemp("lora")
    tokenizer = Path(local_model_dir(f"embedded:{MODEL}") or "")
    source = build_tiny("llama-wide", root / "llama", tokenizer)
    adapters = root / "adapters"
    for i, name in enumerate(ADAPTERS):
        save_random_adapter(source, adapters / name, seed=100 + i)
    save_random_adapter(source, root / "incoming" / "fresh", seed=200)
    save_random_adapter(source, root / "incoming" / "wide", seed=201, rank=32)
    other = build_tiny("llama", root / "other-base")  # hidden size 64, not 256
    save_random_adapter(other, adapters / "foreign", seed=202)
    corrupt = save_random_adapter(source, adapters / "corrupt", seed=203)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    model = ModelConfig(name=LORA_MODEL, source=str(source), num_replicas=2, num_cpus=0.05,
                        engine_args=ENGINE_ARGS,
                        lora=Lora(directory=str(adapters), max_loaded=2, max_rank=16))
    serve.run(build_model_app({"model": msgspec.to_builtins(model)}), name=APP,
              route_prefix=model_route(LORA_MODEL))
    gateway = GatewayConfig(models=[msgspec.structs.replace(model, app=APP)],
                            ingress_num_cpus=0.05)
    serve.run(build_app(gateway), name=GATEWAY_APP, route_prefix=ROUTE)
    _wait_healthy(f"{gateway_url}{ROUTE}", "the LoRA model's gateway")
    handle = serve.get_deployment_handle(f"engine-{LORA_MODEL}", app_name=APP)
    yield f"{gateway_url}{ROUTE}", handle, root
    serve.delete(GATEWAY_APP)
    serve.delete(APP)


@pytest.fixture(scope="module")
def oracle(lora_setup):
    """vLLM's own greedy text for the prompt: base (None) and each adapter."""
    _, handle, root = lora_setup

    def reference(name: str | None, prompt: str | list[int] = PROMPT) -> str:
        adapter = None if name is None else Adapter(name=name, path=str(
            root / ("incoming" if name == "fresh" else "adapters") / name))
        return handle.reference_greedy.remote(prompt, MAX_TOKENS, adapter).result().text

    texts = {name: reference(name) for name in [None, *ADAPTERS, "fresh"]}
    return texts, reference


def _complete(url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **extra})


def test_every_adapter_answers_its_own_output_and_none_the_base_models(lora_setup, oracle):
    url, _, _ = lora_setup
    texts, _ = oracle
    for name in ADAPTERS:
        assert texts[name] != texts[None], f"adapter {name} does not move the greedy output"
    assert len(set(texts[n] for n in ADAPTERS)) > 1
    for name in [None, *ADAPTERS]:
        r = _complete(url, name or LORA_MODEL)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == texts[name], name
        assert r.json()["model"] == (name or LORA_MODEL)


def test_the_sdks_and_each_protocols_own_way_to_name_an_adapter(lora_setup, oracle):
    from huggingface_hub import InferenceClient
    from openai import OpenAI

    url, _, _ = lora_setup
    texts, _ = oracle
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    listed = {m.id: m for m in client.models.list().data}
    assert set(ADAPTERS) <= set(listed) and listed["a3"].model_extra["parent"] == LORA_MODEL
    done = client.completions.create(model="a3", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=0)
    assert done.choices[0].text == texts["a3"]
    tgi = InferenceClient(model=url, timeout=120)
    assert tgi.text_generation(PROMPT, max_new_tokens=MAX_TOKENS, adapter_id="a4") == texts["a4"]
    lmi = httpx.post(f"{url}/invocations", timeout=120,
                     headers={"X-Amzn-SageMaker-Adapter-Identifier": "a5"},
                     json={"inputs": PROMPT, "parameters": {"max_new_tokens": MAX_TOKENS}})
    assert lmi.status_code == 200 and lmi.json()["generated_text"] == texts["a5"], lmi.text
    mindie = httpx.post(f"{url}/v2/models/a6/generate", timeout=120, json={
        "text_input": PROMPT, "parameters": {"max_new_tokens": MAX_TOKENS}})
    assert mindie.status_code == 200 and mindie.json()["text_output"] == texts["a6"], mindie.text


def test_chat_sdks_on_an_adapter_match_vllm_on_the_rendered_prompt(lora_setup, oracle):
    """OpenAI chat (whole and streamed), the Responses API and Anthropic's Messages: one
    conversation on adapter a1, vLLM's own output for its rendered ids the oracle."""
    import anthropic
    from openai import OpenAI

    url, _, _ = lora_setup
    _, reference = oracle
    messages = [{"role": "user", "content": "Tell me about the harbour."}]
    ids = httpx.post(f"{url}/tokenize", timeout=60,
                     json={"model": "a1", "messages": messages}).json()["tokens"]
    expected = reference("a1", ids)
    chat = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).chat.completions
    whole = chat.create(model="a1", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].message.content == expected
    streamed = "".join(c.choices[0].delta.content or "" for c in chat.create(
        model="a1", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        if c.choices)
    assert streamed == expected
    openai_client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    response = openai_client.responses.create(model="a1", input=messages,
                                              max_output_tokens=MAX_TOKENS, temperature=0)
    assert response.model == "a1" and response.output_text == expected
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    reply = claude.messages.create(model="a1", messages=messages, max_tokens=MAX_TOKENS,
                                   extra_body={"temperature": 0})
    assert reply.model == "a1" and reply.content[0].text == expected


async def test_eight_adapters_two_loaded_per_replica_under_mixed_load(lora_setup, oracle):
    """Four requests per adapter and four for the base, at once, in random-looking order:
    each replica cycles adapters through its two slots, and every answer is its adapter's."""
    url, _, _ = lora_setup
    texts, _ = oracle
    names = [ADAPTERS[(i * 5) % 8] if i % 9 else None for i in range(36)]
    async with httpx.AsyncClient(timeout=300) as http:
        async def one(name: str | None) -> str:
            r = await http.post(f"{url}/v1/completions", json={
                "model": name or LORA_MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        answers = await asyncio.gather(*(one(n) for n in names))
    wrong = [(n, a) for n, a in zip(names, answers, strict=True) if a != texts[n]]
    assert not wrong


async def test_load_and_unload_at_runtime_while_streams_run(lora_setup, oracle):
    """A loaded adapter serves at once; unloaded while its streams run, they end whole, and the
    next request for it is a 404."""
    url, _, root = lora_setup
    texts, _ = oracle
    async with httpx.AsyncClient(timeout=300) as http:
        r = await http.post(f"{url}/v1/load_lora_adapter", json={
            "lora_name": "fresh", "lora_path": str(root / "incoming" / "fresh")})
        assert r.status_code == 200, r.text

        async def stream(name: str, started: asyncio.Event) -> str:
            text = ""
            async with http.stream("POST", f"{url}/v1/completions", json={
                    "model": name, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "stream": True}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

        names = ("fresh", "a0", "fresh", "a2")
        started = [asyncio.Event() for _ in names]
        running = [asyncio.ensure_future(stream(n, e)) for n, e in zip(names, started, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        r = await http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "fresh"})
        assert r.status_code == 200, r.text
        done = await asyncio.gather(*running)
        assert done == [texts[n] for n in names]
        r = await http.post(f"{url}/v1/completions", json={"model": "fresh", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_bad_adapters_are_refused_in_shape_and_the_replicas_keep_serving(lora_setup, oracle):
    url, _, root = lora_setup
    texts, _ = oracle
    r = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60, json={
        "lora_name": "wide", "lora_path": str(root / "incoming" / "wide")})
    assert r.status_code == 400 and "rank 32" in r.json()["error"]["message"]
    for name in ("corrupt", "foreign"):
        for _ in range(2):  # each replica may be asked; neither may fail
            r = _complete(url, name)
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert f"adapter `{name}`" in message and str(root) not in message
    assert _complete(url, "missing").status_code == 404
    tgi = httpx.post(f"{url}/generate", timeout=60, json={
        "inputs": PROMPT, "parameters": {"adapter_id": "missing"}})
    assert tgi.status_code == 404 and "missing" in tgi.json()["error"]
    for name in (None, "a7"):
        assert _complete(url, name or LORA_MODEL).json()["choices"][0]["text"] == texts[name]


def test_a_json_schema_grammar_runs_on_an_adapter(lora_setup):
    url, _, _ = lora_setup
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "a2", "messages": [{"role": "user", "content": "A city?"}], "max_tokens": 40,
        "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
            "name": "city", "schema": schema}}})
    assert r.status_code == 200, r.text
    value = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(value) == {"city"} and isinstance(value["city"], str)


async def test_lmtp_generates_on_an_adapter_named_as_the_model(lora_setup):
    """Raw LMTP frames, as LMQL sends them: the adapter's tokens, vLLM's own for its ids."""
    import websockets

    url, handle, root = lora_setup
    ids = httpx.post(f"{url}/tokenize", timeout=60,
                     json={"model": "a0", "prompt": PROMPT}).json()["tokens"]
    adapter = Adapter(name="a0", path=str(root / "adapters" / "a0"))
    native = await handle.reference_greedy.remote(ids, MAX_TOKENS, adapter)
    async with websockets.connect(url.replace("http://", "ws://") + "/") as ws:
        await ws.send("GENERATE " + json.dumps({"model": "a0", "prompt": ids, "stream_id": 1,
                                                "max_tokens": MAX_TOKENS, "temperature": 0}))
        tokens: list[int] = []
        finished = None
        async with asyncio.timeout(120):
            while finished is None:
                _, _, body = (await ws.recv()).partition(" ")
                for item in json.loads(body):
                    assert item.get("error") is None, item
                    tokens.append(item["token"])
                    finished = item.get("finish_reason")
    assert tokens == native.token_ids


def test_aici_runs_a_controller_on_an_adapter_named_as_the_model(lora_setup):
    url, _, _ = lora_setup
    grammar = {"grammars": [{"lark_grammar": "start: /[a-z]{3,6}\\./"}]}
    body = {"controller": "llguidance", "controller_arg": {"grammar": grammar},
            "max_tokens": 10, "model": "a3"}
    r = httpx.post(f"{url}/v1/run", timeout=120, json=body)
    assert r.status_code == 200, r.text
    text = "".join(fork["text"] for line in r.text.splitlines()
                   if line.startswith("data: {") for fork in json.loads(line[6:]).get("forks", []))
    assert text.endswith(".") and text[:-1].isalpha() and text.islower(), text
    assert httpx.post(f"{url}/v1/run", timeout=60,
                      json={**body, "model": "missing"}).status_code == 404

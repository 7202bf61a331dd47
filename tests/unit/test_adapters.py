"""LoRA adapters without an engine (docs/adapters.md): what an adapter folder must hold, the
catalog a model's adapters are found in (its config, its directory, links made at runtime),
resolution by name in the registry, every protocol's way to name an adapter against the fake
engine (which answers "<adapter>: Hello world"), vLLM's load/unload routes, metrics and
routing keys. The same against vLLM with real adapters: tests/e2e/test_adapters_e2e.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from contract import (
    Adapter,
    AdapterInvalid,
    AdapterNotFound,
    Capabilities,
    GenerateRequest,
    ModelInfo,
    ModelNotFound,
    TextPrompt,
)
from engines.caller.prefix_affinity import prefix_blocks
from engines.caller.routing import request_blocks
from engines.kit.config import Lora, ModelConfig
from engines.kit.lora import check_fits, model_shapes, read_adapter, write_zero_adapter
from engines.replica.admission import Refused, check_request
from engines.vllm.adapters import lora_engine_args
from gateway.config import GatewayConfig, load_config
from gateway.ingress import adapters as catalog_module
from gateway.ingress.adapters import AdapterCatalog
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import AdapterEngine, ModelRegistry
from tests.fake_engine import FakeEngine
from tests.recorded_metrics import Recorded

REPLY = "Hello world"


def make_adapter(folder: Path, rank: int = 8, peft_type: str = "LORA", weights: bool = True,
                 config: str | None = None) -> Path:
    """A folder in PEFT's layout (the weights' bytes are the fake engine's business: none)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = config if config is not None else json.dumps(
        {"peft_type": peft_type, "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"],
         "base_model_name_or_path": "tiny"})
    (folder / "adapter_config.json").write_text(text)
    if weights:
        (folder / "adapter_model.safetensors").write_bytes(b"weights")
    return folder


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- what an adapter folder must hold ---------------------------------------------------------


def test_a_peft_lora_folder_is_read_for_its_rank_and_base(tmp_path):
    facts = read_adapter("a", str(make_adapter(tmp_path / "a", rank=8)), max_rank=16)
    assert (facts.rank, facts.base_model) == (8, "tiny")


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"rank": 32}, "rank 32, over this model's bound of 16"),
    ({"peft_type": "PREFIX_TUNING"}, "not a LoRA adapter"),
    ({"weights": False}, "has no weights"),
    ({"config": "{not json"}, "not readable JSON"),
    ({"config": json.dumps({"peft_type": "LORA", "r": "8"})}, "not a positive integer"),
])
def test_a_folder_that_is_not_a_servable_adapter_is_refused_by_name_not_path(tmp_path, kwargs,
                                                                            words):
    folder = make_adapter(tmp_path / "secret-place", **kwargs)
    with pytest.raises(AdapterInvalid, match=words) as caught:
        read_adapter("mine", str(folder), max_rank=16)
    assert "`mine`" in str(caught.value) and "secret-place" not in str(caught.value)


def test_a_folder_without_adapter_config_is_not_a_peft_adapter(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterInvalid, match=r"no adapter_config\.json"):
        read_adapter("empty", str(tmp_path / "empty"), max_rank=16)


def _factors(folder: Path, width_in: int, width_out: int, layer: int = 0) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    make_adapter(folder, weights=False)
    save_file({f"{prefix}.lora_A.weight": np.zeros((8, width_in), np.float32),
               f"{prefix}.lora_B.weight": np.zeros((width_out, 8), np.float32)},
              str(folder / "adapter_model.safetensors"))
    return folder


def test_an_adapter_must_fit_the_models_widths_and_layers(tmp_path):
    from transformers import LlamaConfig

    shapes = model_shapes(LlamaConfig(hidden_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2,
                                      intermediate_size=512))
    assert shapes.modules["k_proj"] == (256, 128) and shapes.modules["down_proj"] == (512, 256)
    check_fits("ok", str(_factors(tmp_path / "ok", 256, 256)), shapes)
    for folder, args in (("narrow", (64, 256)), ("short", (256, 64)), ("deep", (256, 256, 5))):
        with pytest.raises(AdapterInvalid, match=f"adapter `{folder}` does not fit"):
            check_fits(folder, str(_factors(tmp_path / folder, *args)), shapes)
    broken = make_adapter(tmp_path / "broken")  # "weights": not a safetensors header
    with pytest.raises(AdapterInvalid, match="not readable safetensors"):
        check_fits("broken", str(broken), shapes)


# --- the catalog -------------------------------------------------------------------------------


def test_the_catalog_serves_configured_adapters_and_the_directorys_folders(tmp_path):
    make_adapter(tmp_path / "dir" / "sql")
    make_adapter(tmp_path / "dir" / "not a plain name")
    (tmp_path / "dir" / "no-config").mkdir()
    catalog = AdapterCatalog("base", Lora(directory=str(tmp_path / "dir"),
                                          adapters={"chat": str(tmp_path / "elsewhere")}))
    assert catalog.names() == ["chat", "sql"]
    assert catalog.find("sql").path == str(tmp_path / "dir" / "sql")
    # A configured adapter is found whatever its folder holds: the replica says what is wrong.
    assert catalog.find("chat").path == str(tmp_path / "elsewhere")
    assert catalog.find("no-config") is None and catalog.find("../dir/sql") is None


def test_a_new_folder_is_found_on_the_next_lookup_after_a_second_and_a_removed_one_at_once(
        tmp_path):
    clock = Clock()
    catalog = AdapterCatalog("base", Lora(directory=str(tmp_path)), clock=clock)
    assert catalog.find("late") is None  # listed now
    make_adapter(tmp_path / "late")
    assert catalog.find("late") is None  # not listed again within the second
    clock.now += catalog_module.RESCAN_S
    assert catalog.find("late") is not None
    (tmp_path / "late" / "adapter_config.json").unlink()
    (tmp_path / "late" / "adapter_model.safetensors").unlink()
    (tmp_path / "late").rmdir()
    assert catalog.find("late") is None


def test_linking_serves_a_folder_under_a_name_and_unlinking_stops_it(tmp_path):
    directory = tmp_path / "dir"
    directory.mkdir()
    source = make_adapter(tmp_path / "incoming" / "v2")
    catalog = AdapterCatalog("base", Lora(directory=str(directory)))
    adapter = catalog.link("sql", str(source))
    assert adapter is not None and os.path.realpath(adapter.path) == str(source)
    # Another process reading the same directory finds it at once (nothing listed yet).
    assert AdapterCatalog("base", Lora(directory=str(directory))).find("sql") is not None
    with pytest.raises(AdapterInvalid, match="already loaded"):
        catalog.link("sql", str(source))
    assert catalog.unlink("sql") and catalog.find("sql") is None
    assert not catalog.unlink("sql")
    assert source.is_dir()  # the folder itself is the operator's


def test_linking_refuses_bad_names_bad_folders_and_a_model_without_a_directory(tmp_path):
    good = make_adapter(tmp_path / "good")
    catalog = AdapterCatalog("base", Lora(directory=str(tmp_path / "dir"), max_rank=8))
    (tmp_path / "dir").mkdir()
    for name in ("../x", "base", ""):
        with pytest.raises(AdapterInvalid, match="cannot name an adapter"):
            catalog.link(name, str(good))
    with pytest.raises(AdapterInvalid, match="no folder"):
        catalog.link("x", str(tmp_path / "missing"))
    with pytest.raises(AdapterInvalid, match="rank 16"):
        catalog.link("x", str(make_adapter(tmp_path / "wide", rank=16)))
    with pytest.raises(AdapterInvalid, match="no adapter directory"):
        AdapterCatalog("base", Lora()).link("x", str(good))


# --- configuration --------------------------------------------------------------------------


def test_a_kind_that_serves_no_adapters_refuses_a_lora_entry():
    with pytest.raises(ValueError, match="pipeline engine serves no LoRA adapters"):
        ModelConfig(name="p", engine="pipeline", lora=Lora())


def test_adapter_names_must_differ_from_models_aliases_and_each_other():
    with pytest.raises(ValueError, match="cannot share its model's name"):
        ModelConfig(name="m", lora=Lora(adapters={"m": "/a"}))
    with pytest.raises(ValueError, match=r"adapter names must differ.*\['other'\]"):
        load_config({"models": [{"name": "m", "lora": {"adapters": {"other": "/a"}}},
                                {"name": "other"}]})
    with pytest.raises(ValueError, match="plain name"):
        Lora(adapters={"a/b": "/a"})


def test_vllm_gets_lora_on_with_the_rank_rounded_up_and_a_slot_for_base_requests():
    assert lora_engine_args(Lora(max_loaded=2, max_rank=12), base_slot=False) == {
        "enable_lora": True, "max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": 16}
    # On vLLM's CPU backend base requests run with a zero adapter, in a slot of their own.
    assert lora_engine_args(Lora(max_loaded=2), base_slot=True)["max_loras"] == 3
    with pytest.raises(ValueError, match="over vLLM's largest"):
        lora_engine_args(Lora(max_rank=1024), base_slot=False)


def test_the_zero_adapter_is_a_peft_lora_that_fits_the_model(tmp_path):
    from transformers import LlamaConfig

    shapes = model_shapes(LlamaConfig(hidden_size=256, num_attention_heads=4,
                                      num_hidden_layers=2, intermediate_size=512))
    folder = write_zero_adapter(str(tmp_path / "zero"), shapes)
    assert read_adapter("zero", folder, max_rank=1).rank == 1
    check_fits("zero", folder, shapes)


def test_a_request_naming_an_adapter_is_refused_by_an_engine_without_adapters():
    info = ModelInfo(name="m", root="m", max_model_len=64, vocab_size=100,
                     capabilities=Capabilities(adapters=False))
    request = GenerateRequest(request_id="r", model="m", prompt=TextPrompt(text="hi"),
                              adapter=Adapter(name="sql", path="/a"))
    with pytest.raises(Refused, match="serves no LoRA adapters"):
        check_request(request, info)


# --- the registry --------------------------------------------------------------------------


@pytest.fixture
def adapter_dir(tmp_path) -> Path:
    for name in ("sql", "poet"):
        make_adapter(tmp_path / "adapters" / name)
    return tmp_path / "adapters"


def _registry(adapter_dir: Path, engine: FakeEngine | None = None) -> ModelRegistry:
    return ModelRegistry({"fake-model": engine or FakeEngine()}, {"ensemble": "fake-model"},
                         adapters={"fake-model": AdapterCatalog(
                             "fake-model", Lora(directory=str(adapter_dir)))})


async def test_an_adapters_name_resolves_to_its_models_engine_running_it(adapter_dir):
    engine = FakeEngine()
    registry = _registry(adapter_dir, engine)
    name, client = registry.resolve("sql")
    assert name == "sql" and isinstance(client, AdapterEngine) and client.base == "fake-model"
    request = GenerateRequest(request_id="r", model="sql", prompt=TextPrompt(text="hi"))
    text = "".join([e.text async for e in client.generate(request) if hasattr(e, "text")])
    assert text == f"sql: {REPLY}"
    sent = engine.requests[-1]
    assert sent.model == "fake-model" and sent.adapter.name == "sql"
    assert registry.adapters() == [("poet", "fake-model"), ("sql", "fake-model")]
    assert registry.parent("sql") == "fake-model" and registry.parent("ensemble") is None
    assert (await registry.info("sql")).name == "sql"


def test_an_adapter_named_beside_its_model_resolves_only_on_that_model(adapter_dir):
    registry = _registry(adapter_dir)
    name, client = registry.resolve_adapter("ensemble", "poet")
    assert name == "fake-model" and client.adapter.name == "poet"
    with pytest.raises(AdapterNotFound, match="has no adapter `nope`"):
        registry.resolve_adapter("fake-model", "nope")
    with pytest.raises(ModelNotFound):
        registry.resolve("nope")
    plain = ModelRegistry({"fake-model": FakeEngine()})
    with pytest.raises(AdapterNotFound):
        plain.resolve_adapter(None, "sql")
    with pytest.raises(AdapterInvalid, match="serves no LoRA adapters"):
        plain.load_adapter("fake-model", "x", "/x")


# --- every protocol -----------------------------------------------------------------------


@pytest.fixture
async def http(adapter_dir):
    app = create_app(_registry(adapter_dir), GatewayConfig())
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield client


MAX = 40


async def test_openai_chat_and_completions_run_the_adapter_named_as_the_model(http):
    r = await http.post("/v1/chat/completions", json={
        "model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    assert r.json()["choices"][0]["message"]["content"] == f"sql: {REPLY}"
    r = await http.post("/v1/completions", json={"model": "poet", "prompt": "hi",
                                                  "max_tokens": MAX})
    assert r.json()["choices"][0]["text"] == f"poet: {REPLY}"
    r = await http.post("/v1/completions", json={"model": "fake-model", "prompt": "hi",
                                                  "max_tokens": MAX})
    assert r.json()["choices"][0]["text"] == REPLY


async def test_the_model_listing_shows_adapters_with_their_parent(http):
    cards = {c["id"]: c for c in (await http.get("/v1/models")).json()["data"]}
    assert cards["sql"]["parent"] == "fake-model" and cards["fake-model"]["parent"] is None
    one = (await http.get("/v1/models/poet")).json()
    assert one["id"] == "poet" and one["parent"] == "fake-model"
    assert (await http.get("/v1/models/nope")).status_code == 404


async def test_responses_and_anthropic_run_the_adapter_named_as_the_model(http):
    r = await http.post("/v1/responses", json={"model": "sql", "input": "hi",
                                               "max_output_tokens": MAX})
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == f"sql: {REPLY}"
    r = await http.post("/v1/messages", json={
        "model": "poet", "max_tokens": MAX, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == f"poet: {REPLY}" and r.json()["model"] == "poet"


async def test_tgi_runs_the_adapter_id_and_answers_an_unknown_one_404_in_shape(http):
    r = await http.post("/generate", json={"inputs": "hi", "parameters": {
        "adapter_id": "sql", "max_new_tokens": MAX}})
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == f"sql: {REPLY}"
    r = await http.post("/generate", json={"inputs": "hi", "parameters": {"adapter_id": "nope"}})
    assert r.status_code == 404 and "has no adapter `nope`" in r.json()["error"]
    r = await http.post("/generate", json={"inputs": "hi", "parameters": {"adapter_id": 3}})
    assert r.status_code == 422 and "must name one LoRA adapter" in r.json()["error"]


async def test_lmi_runs_the_sagemaker_header_or_the_adapters_field(http):
    header = {"X-Amzn-SageMaker-Adapter-Identifier": "sql"}
    r = await http.post("/invocations", headers=header,
                        json={"inputs": "hi", "parameters": {"max_new_tokens": MAX}})
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"] == f"sql: {REPLY}"
    r = await http.post("/invocations", json={"inputs": "hi", "adapters": "poet",
                                              "parameters": {"max_new_tokens": MAX}})
    assert r.json()["generated_text"] == f"poet: {REPLY}"
    r = await http.post("/invocations", headers=header, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX})
    assert r.json()["choices"][0]["message"]["content"] == f"sql: {REPLY}"
    r = await http.post("/invocations", headers={"X-Amzn-SageMaker-Adapter-Identifier": "no"},
                        json={"inputs": "hi"})
    assert r.status_code == 404 and "has no adapter `no`" in r.text


async def test_mindie_runs_the_adapter_in_the_path_or_its_adapter_id(http):
    body = {"text_input": "hi", "parameters": {"max_new_tokens": MAX}}
    r = await http.post("/v2/models/sql/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == f"sql: {REPLY}"
    body["parameters"]["adapter_id"] = "poet"
    r = await http.post("/v2/models/fake-model/generate", json=body)
    assert r.json()["text_output"] == f"poet: {REPLY}"
    body["parameters"]["adapter_id"] = "nope"
    assert (await http.post("/v2/models/fake-model/generate", json=body)).status_code == 404


async def test_vllms_load_and_unload_routes_link_an_adapter_in_and_out(http, tmp_path):
    source = make_adapter(tmp_path / "incoming" / "fresh")
    r = await http.post("/v1/load_lora_adapter", json={"lora_name": "fresh",
                                                       "lora_path": str(source)})
    assert r.status_code == 200 and r.text == \
        "Success: LoRA adapter 'fresh' added successfully."
    r = await http.post("/v1/completions", json={"model": "fresh", "prompt": "hi",
                                                  "max_tokens": MAX})
    assert r.json()["choices"][0]["text"] == f"fresh: {REPLY}"
    r = await http.post("/v1/load_lora_adapter", json={"lora_name": "fresh",
                                                       "lora_path": str(source)})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"})
    assert r.status_code == 200 and "removed successfully" in r.text
    r = await http.post("/v1/completions", json={"model": "fresh", "prompt": "hi"})
    assert r.status_code == 404
    r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 404  # the operator's folder, not loaded at runtime


async def test_loading_a_folder_that_is_not_an_adapter_is_a_400_naming_the_adapter(http,
                                                                                 tmp_path):
    wide = make_adapter(tmp_path / "hidden-path", rank=64)
    r = await http.post("/v1/load_lora_adapter", json={"lora_name": "wide",
                                                       "lora_path": str(wide)})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "rank 64" in message and "hidden-path" not in message
    r = await http.post("/v1/load_lora_adapter", json={"lora_name": "fake-model",
                                                       "lora_path": str(wide)})
    assert r.status_code == 400 and "a model's name" in r.json()["error"]["message"]
    assert (await http.post("/v1/load_lora_adapter", json={"lora_name": 1})).status_code == 400


# --- metrics and routing ------------------------------------------------------------------


async def test_adapter_generations_are_counted_by_adapter_as_well_as_by_model(adapter_dir):
    recorded = Recorded()
    settings = GatewayConfig(models=[ModelConfig(name="fake-model")])
    app = create_app(_registry(adapter_dir), settings, metrics=recorded.metrics())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        r = await http.post("/v1/completions", json={"model": "sql", "prompt": "hi",
                                                      "max_tokens": 4})
    usage = r.json()["usage"]
    tags = {"model": "fake-model", "adapter": "sql"}
    assert recorded.count("llm_gateway_adapter_requests", **tags, outcome="length") == 1
    assert recorded.count("llm_gateway_adapter_tokens", **tags, kind="generated") == 4
    assert recorded.count("llm_gateway_adapter_tokens", **tags, kind="prompt") == \
        usage["prompt_tokens"]
    assert recorded.count("llm_gateway_generation_tokens", model="fake-model",
                          protocol="openai", engine="vllm") == 4


def test_an_adapters_prompts_are_keyed_apart_and_share_a_key_for_the_adapter():
    text = "x" * 1024
    base, sql, poet = prefix_blocks(text), prefix_blocks(text, "sql"), prefix_blocks(text, "poet")
    assert len(sql) == len(base) + 1 and not set(sql) & set(base)
    assert sql[0] != poet[0] and prefix_blocks("short", "sql") == (sql[0],)
    request = GenerateRequest(request_id="r", model="m", prompt=TextPrompt(text=text),
                              adapter=Adapter(name="sql", path="/a"))
    assert request_blocks([request]) == (sql, False)

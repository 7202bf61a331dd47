"""The cluster files: `cluster.yaml` and the cloud example pass Ray's own cluster-config
validation (the autoscaler's schema, after Ray fills in its defaults as `ray up` does), and
`serve_config.cluster.yaml` passes Serve's schema, the gateway's config and `build_app`, with
the replica options it promises (autoscaling, fixed replicas, placement by node resources)."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import msgspec
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from engines.kit.config import Autoscaling, ModelConfig
from gateway.app import build_app, build_engine_app, build_model_app
from gateway.config import load_config
from gateway.model_replica.ingress import load_model_app
from gateway.model_routes import model_route

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster.aws-gpu.yaml"])
def test_cluster_files_pass_rays_validator(name):
    prepared = prepare_config(_load(name))
    validate_config(prepared)
    assert prepared["cluster_name"].startswith("llm-gateway")
    starts = prepared["head_start_ray_commands"] + prepared["worker_start_ray_commands"]
    assert all("scripts/ray_node.sh" in command for command in starts)
    assert prepared["setup_commands"] == ["bash ~/llm-gateway/scripts/install.sh"]


def test_the_validator_catches_a_misspelt_field():
    """The validation above means something: a typo in a top-level field is refused."""
    config = _load("cluster.yaml")
    config["setup_comands"] = config.pop("setup_commands")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))


def test_local_cluster_starts_every_listed_worker():
    config = copy.deepcopy(_load("cluster.yaml"))
    config["provider"]["worker_ips"] = ["10.0.0.2", "10.0.0.3"]
    prepared = prepare_config(config)
    validate_config(prepared)
    node_type = prepared["available_node_types"][prepared["head_node_type"]]
    assert node_type["min_workers"] == node_type["max_workers"] == 2


def test_the_gpu_example_places_workers_by_the_engine_resource():
    prepared = prepare_config(_load("cluster.aws-gpu.yaml"))
    workers = prepared["available_node_types"]["gpu_worker"]
    assert workers["resources"] == {"llm_gateway_gpu_engine": 1}
    assert workers["max_workers"] >= workers["min_workers"] >= 1


@pytest.mark.parametrize("name", ["serve_config.cluster.yaml", "serve_config.yaml"])
def test_the_serve_configs_build_each_model_its_own_application(name):
    """Each model in its own application at /model/<name>, the gateway naming them with the
    same entries and settings (YAML merge keys); the gateway binds no engine of its own."""
    serve_config = _load(name)
    ServeDeploySchema.model_validate(serve_config)
    apps = {a["name"]: a for a in serve_config["applications"]}
    gateway_args = apps.pop("gateway")["args"]
    config = load_config(gateway_args)
    assert {m.app for m in config.models} == set(apps)
    for model in config.models:
        app = apps[model.app]
        assert app["import_path"] == "gateway.app:build_model_app"
        assert app["route_prefix"] == model_route(model.name)
        own, settings = load_model_app(app["args"])
        assert msgspec.structs.replace(own, app=model.app) == model
        assert settings.keys() == config.keys() and settings.protocols == config.protocols
        deployment = build_model_app(app["args"])._bound_deployment
        assert deployment.name == f"engine-{model.name}"
    ingress = build_app(gateway_args)._bound_deployment
    assert ingress.init_args[0] == {}
    assert ingress._deployment_config.max_surge_percent == 100


def test_the_cluster_serve_config_keeps_its_replica_options():
    """Autoscaling, fixed replicas and placement by node resources reach the models' own
    applications."""
    apps = {a["name"]: a for a in _load("serve_config.cluster.yaml")["applications"]}
    vllm = build_model_app(apps["model-smollm2"]["args"])._bound_deployment
    pipeline = build_model_app(apps["model-smollm2-pipeline"]["args"])._bound_deployment
    scaling = vllm._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 2)
    assert scaling.target_ongoing_requests == 8
    assert vllm._replica_config.ray_actor_options["resources"] == {"llm_gateway_cpu_engine": 0.01}
    assert pipeline._deployment_config.num_replicas == 2
    assert pipeline._deployment_config.autoscaling_config is None
    # Serve refuses in plain text beyond this (direct ingress): above the gateway's own bounds.
    for deployment in (vllm, pipeline):
        assert deployment._deployment_config.max_ongoing_requests >= 512


def test_a_model_application_takes_the_gateways_settings_for_its_model_only():
    model, config = load_model_app({"model": {"name": "a", "engine": "pipeline"},
                                    "gateway": {"api_key": "k", "aliases": {"x": "a", "y": "b"},
                                                "tgi_model": "b"}})
    assert [m.name for m in config.models] == ["a"] and model.name == "a"
    assert config.aliases == {"x": "a"} and config.tgi_model is None and config.api_key == "k"
    with pytest.raises(ValueError, match="settings list no models"):
        load_model_app({"model": {"name": "a", "engine": "pipeline"},
                        "gateway": {"models": [{"name": "b"}]}})
    with pytest.raises(ValueError, match="invalid model application config"):
        load_model_app({"model": {"name": "a", "engine": "pipeline"}, "extra": 1})


def test_models_inside_the_gateway_app_are_bound_there():
    args = {"models": [{"name": "a", "engine": "pipeline"},
                       {"name": "b", "engine": "pipeline", "app": "model-b"}]}
    engines = build_app(args)._bound_deployment.init_args[0]
    assert set(engines) == {"a"}


def test_a_bad_engine_app_config_is_refused():
    with pytest.raises(ValueError, match="invalid model config"):
        build_engine_app({"name": "m", "engine": "pipeline", "num_replicas": 0})


def test_autoscaling_bounds_the_pending_limit_by_its_maximum():
    fixed = ModelConfig(engine="pipeline", num_replicas=1)
    scaled = ModelConfig(engine="pipeline", autoscaling=Autoscaling(min_replicas=1,
                                                                    max_replicas=3))
    assert scaled.pending_limit() == fixed.pending_limit() + 2 * fixed.ongoing_limit()
    assert scaled.replica_options() == {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4.0,
        "look_back_period_s": 30.0, "upscale_delay_s": 10.0, "downscale_delay_s": 60.0}}


@pytest.mark.parametrize("bad", [
    {"min_replicas": 0, "max_replicas": 2},
    {"min_replicas": 3, "max_replicas": 2},
    {"initial_replicas": 5, "max_replicas": 2},
    {"target_ongoing_requests": 0},
    {"look_back_period_s": 0},
    {"upscale_delay_s": -1},
])
def test_bad_autoscaling_is_refused_when_the_config_loads(bad):
    with pytest.raises(ValueError, match="autoscaling"):
        load_config({"models": [{"name": "m", "engine": "pipeline", "autoscaling": bad}]})


def test_bad_resources_are_refused():
    with pytest.raises(ValueError, match="resources"):
        load_config({"models": [{"name": "m", "engine": "pipeline",
                                 "resources": {"llm_gateway_cpu_engine": 0}}]})

"""Ray Serve LLM (``ray.serve.llm.build_openai_app``) on one model, the peer ``compare.py``
measures the gateway against: same engine args as the gateway's replica, one replica, on CPU.

    serve run CONFIG  # import_path bench.serve_llm_app:build, args model_id, model_dir,
                      # engine_args (overrides of the gateway's defaults)

Ray Serve LLM sizes its deployments in whole logical CPUs (the engine's placement group, the
LLM server replica, the OpenAI ingress), more than a 2-core box advertises; ``compare.py``
starts it with ``RAY_OVERRIDE_RESOURCES`` giving Ray more logical CPUs, which changes nothing
about the cores the processes actually share.
"""

from __future__ import annotations

from engines.vllm.args import engine_args as gateway_engine_args


def build(args: dict):
    from ray.serve.llm import LLMConfig, build_openai_app

    # Exactly the engine args the gateway's replica and the benches' bare server get.
    engine_kwargs = gateway_engine_args(args.get("engine_args") or {})
    config = LLMConfig(
        model_loading_config={"model_id": args["model_id"], "model_source": args["model_dir"]},
        engine_kwargs=engine_kwargs,
        accelerator_config={"kind": "cpu"},
        placement_group_config={"bundles": [{"CPU": 1}]},
        deployment_config={"num_replicas": 1},
    )
    return build_openai_app({"llm_configs": [config]})

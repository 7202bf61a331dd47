"""Ray Serve LLM (``ray.serve.llm.build_openai_app``) on one model, the peer ``compare.py``
measures the gateway against: same engine args as the gateway's replica, one replica, on CPU.

    serve run CONFIG  # import_path bench.serve_llm_app:build, args model_id, model_dir,
                      # engine_args (overrides of the gateway's defaults), num_replicas,
                      # router ("prefix": its PrefixCacheAffinityRouter; else its default)

With ``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1`` in Ray's environment (``bench/servers.py``'s
``serve-llm`` targets), the way Ray Serve LLM's users run it since Ray 2.56: the LLM server
replicas are the ingress themselves behind HAProxy, and its ``LLMRouter`` picks the replica of
each request for HAProxy (the peer of ``gateway.model_replica.router``).

Ray Serve LLM sizes its deployments in whole logical CPUs (the engine's placement group, the
LLM server replica, the OpenAI ingress), more than a 2-core box advertises; ``compare.py``
starts it with ``RAY_OVERRIDE_RESOURCES`` giving Ray more logical CPUs, which changes nothing
about the cores the processes actually share.
"""

from __future__ import annotations

from engines.vllm.args import engine_args as gateway_engine_args


def build(args: dict):
    from ray.serve.llm import LLMConfig, build_openai_app

    # Exactly the engine args the gateway's replica and the benches' bare server get, and the
    # per-request count of cached prompt tokens in usage (a frontend option of vLLM's; the
    # gateway always reports it).
    engine_kwargs = {**gateway_engine_args(args.get("engine_args") or {}),
                     "enable_prompt_tokens_details": True}
    deployment: dict = {"num_replicas": args.get("num_replicas", 1)}
    if args.get("router") == "prefix":  # Ray Serve LLM's prefix-aware router
        deployment["request_router_config"] = {
            "request_router_class": "ray.serve.llm.request_router:PrefixCacheAffinityRouter"}
    config = LLMConfig(
        model_loading_config={"model_id": args["model_id"], "model_source": args["model_dir"]},
        engine_kwargs=engine_kwargs,
        accelerator_config={"kind": "cpu"},
        placement_group_config={"bundles": [{"CPU": 1}]},
        deployment_config=deployment,
    )
    return build_openai_app({"llm_configs": [config]})

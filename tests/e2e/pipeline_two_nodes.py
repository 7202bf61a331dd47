"""Run as a program (``python -m tests.e2e.pipeline_two_nodes``) by the two-node test: a Ray
cluster of a head and a worker node on this machine (``ray.cluster_utils.Cluster``, distinct
custom resources), the embedded model as a 2-stage pipeline placed once by custom resources and
once by a STRICT_SPREAD placement group, and its greedy output next to the unsplit model's.
Prints one JSON line; a subprocess so its Ray cluster never meets the test session's."""

from __future__ import annotations

import asyncio
import json
import os


async def _run(engine, prompt: str, tokens: int) -> list[int]:
    from contract import GenerateRequest, Sampling, TextPrompt, TokenEvent
    from engines.replica.host import EngineHost

    request = GenerateRequest(request_id=f"two-nodes-{id(engine)}", model="p",
                              prompt=TextPrompt(text=prompt),
                              sampling=Sampling(temperature=0, max_tokens=tokens))
    return [e.token_id async for e in EngineHost(engine).generate(request)
            if isinstance(e, TokenEvent)]


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    from engines.kit.config import ModelConfig
    from engines.pipeline.engine import PipelineEngine

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    result: dict = {"nodes": len([n for n in ray.nodes() if n["Alive"]])}
    try:
        placements = {
            "resources": {"stage_resources": [{"node_a": 0.5}, {"node_b": 0.5}]},
            "strict_spread": {"placement_strategy": "STRICT_SPREAD"},
        }
        reference = None
        for label, placement in placements.items():
            engine = PipelineEngine(ModelConfig(
                name="p", engine="pipeline",
                engine_args={"num_stages": 2, "stage_num_cpus": 0.25, **placement}))
            where = asyncio.run(engine.stages.where())
            tokens = asyncio.run(_run(engine, "The capital of France is", 10))
            if reference is None:
                reference = asyncio.run(engine.reference_greedy("The capital of France is", 10))
            result[label] = {"nodes": [w["node_id"] for w in where], "tokens": tokens}
            for actor in engine.stages.actors:
                ray.kill(actor)
        assert reference is not None
        result["reference"] = reference.token_ids
        result["node_ids"] = {"node_a": _node_with(ray, "node_a"),
                              "node_b": _node_with(ray, "node_b")}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result))


def _node_with(ray, resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if resource in n["Resources"])


if __name__ == "__main__":
    main()

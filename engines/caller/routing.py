"""How a model's engine deployment is routed by prefix (docs/routing.md): the deployment
options that install the request router (``engines.caller.prefix_router``), the question HAProxy's
router asks it (``RouteQuery``), and where a request says its prompt.

Apart from the router class on purpose: Serve pickles the module of a request router by value
into every process that routes, so a class defined there would be a copy there, and a
``RouteQuery`` made by ``gateway.model_replica.router`` would not be an instance of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from contract import GenerateRequest
from engines.caller.prefix_affinity import request_keys
from engines.kit.config import ModelConfig

__all__ = ["ROUTING_STATS_KEY", "ROUTING_STATS_PERIOD_S", "RouteQuery", "request_blocks",
           "routing_options"]

# The replicas' routing stats (engines.replica.deployment.EngineReplica.record_routing_stats): the last
# keys of the prompts each was sent (engines.caller.prefix_affinity.RecentPrompts).
ROUTING_STATS_KEY = "llm_gateway_prefixes"
# How often Serve's controller collects them: a router learns another's decision at most this
# much later (it knows its own at once).
ROUTING_STATS_PERIOD_S = 1.0


class RouteQuery(msgspec.Struct, frozen=True):
    """A routing question without the request: the prompt's keys, read from an HTTP body."""

    blocks: tuple[int, ...]


def request_blocks(args: Sequence[Any]) -> tuple[tuple[int, ...], bool]:
    """The prompt keys of a call to the engine deployment (its positional ``args``), and
    whether it is a question only (no request follows through the router that answers it).
    A :class:`GenerateRequest` (``generate`` / ``generate_to``) or a :class:`RouteQuery`;
    anything else (``tokenize``, health checks) has none and is routed by load."""
    first = args[0] if args else None
    if isinstance(first, RouteQuery):
        return first.blocks, True
    if isinstance(first, GenerateRequest):
        return request_keys(first), False
    return (), False


def routing_options(model: ModelConfig) -> dict[str, Any]:
    """The engine deployment's options that make Serve route the model's requests with the
    prefix-aware router (none where it does not route by prefix: one replica, or
    ``routing.policy: load``)."""
    if not model.routes_by_prefix():
        return {}
    from ray.serve.config import RequestRouterConfig

    kwargs = {"model": model.name, "max_imbalance": model.routing_imbalance(),
              "memory_blocks": model.routing.memory_blocks}
    return {"request_router_config": RequestRouterConfig(
        request_router_class="engines.caller.prefix_router:PrefixAwareRouter",
        request_router_kwargs=kwargs, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)}

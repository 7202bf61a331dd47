"""The gateway's Serve applications, as ``serve run`` / ``serve deploy`` build them: the
gateway (``build_app``: its ingress replicas and the engine deployments of models inside it), a
model's engine replicas as an application of their own (``build_engine_app``), and a model's own
application that also answers HTTP (``build_model_app``). Builders only: what runs in each
process lives in ``gateway/ingress/``, ``gateway/model_replica/``, ``gateway/edge/``,
``gateway/cluster/`` and ``engines/`` (docs/tour.md).
"""

from __future__ import annotations

from typing import Any

import msgspec
from ray import serve

from engines.kit.config import ModelConfig
from gateway.config import GatewayConfig, load_config
from gateway.ingress.asgi import GatewayIngress
from gateway.model_routes import engine_deployment

__all__ = ["build_app", "build_engine_app", "build_model_app"]


def _engine_app(model: ModelConfig) -> serve.Application:
    from engines.caller.routing import routing_options
    from engines.replica.deployment import EngineDeployment

    return EngineDeployment.options(
        name=engine_deployment(model.name),
        max_ongoing_requests=model.ongoing_limit(),
        # Serve counts a request as queued until a replica is picked for it, so a burst that
        # arrives at once overflowed a bound of queue_limit() while the replicas' own slots
        # were still free (CI saw 4 of 12 admitted requests run). Each ingress replica already
        # refuses beyond pending_limit() itself; Serve's bound is the same figure, a backstop.
        max_queued_requests=_serve_queue_bound(model),
        health_check_period_s=model.health_check_period_s,
        ray_actor_options=model.actor_options(),
        **model.replica_options(),
        **routing_options(model),
    ).bind(model)


def _serve_queue_bound(model: ModelConfig) -> int:
    limit = model.pending_limit()
    return -1 if limit is None else limit


def build_app(args: dict[str, Any] | GatewayConfig | None = None) -> serve.Application:
    """``serve run gateway.app:build_app`` entry point (args: a :class:`GatewayConfig` mapping).
    Models with ``app`` set are served by that Serve application (``build_engine_app``), the
    others by engine deployments inside this one."""
    config = load_config(args)
    engines = {model.name: _engine_app(model) for model in config.models
               if model.app is None and not model.colocated}
    return GatewayIngress.options(
        num_replicas=config.ingress_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        # A redeploy (say, a model added) starts the new ingress replicas before the old ones
        # stop, so requests never find no ingress.
        max_surge_percent=100,
        # Serve replaces a dead ingress after its health check notices (default every 10 s);
        # requests meanwhile are refused by the proxy (gateway.edge.ingress_watch), not served.
        health_check_period_s=2.0,
        ray_actor_options=config.ingress_actor_options(),
    ).bind(engines, config)


def build_engine_app(args: dict[str, Any] | ModelConfig) -> serve.Application:
    """``import_path: gateway.app:build_engine_app``: one model's engine replicas as their own
    Serve application (args: that model's entry, a :class:`ModelConfig` mapping). Serve
    restarts an application's replicas whenever its args change; a model in its own
    application keeps its replicas when the gateway's config (the model list) changes."""
    from gateway.model_replica.router import with_ingress_router

    try:
        model = args if isinstance(args, ModelConfig) else msgspec.convert(args or {}, ModelConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid model config: {exc}") from None
    return with_ingress_router(_engine_app(model), model)


def build_model_app(args: dict[str, Any]) -> serve.Application:
    """``import_path: gateway.app:build_model_app``: one model's own application, its replicas
    serving it over HTTP too (``gateway.model_replica.ingress``; args: ``model``, its entry, and
    ``gateway``, the gateway's settings). Give it ``route_prefix: /model/<name>``."""
    from gateway.model_replica.ingress import load_model_app, model_deployment

    return model_deployment(*load_model_app(args))

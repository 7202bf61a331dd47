"""A model's own Serve application: its engine replicas, each one also the HTTP server of every
protocol for that model (docs/cluster.md, "The default layout").

Behind HAProxy on the public port, a request that names a model served this way (in its JSON
body's ``model`` or in its path, as each protocol declares: ``ProtocolSpec.model_in_body`` /
``model_in_path``) goes straight to one of the model's replicas (``gateway.edge.haproxy_models``):
the protocol layer runs beside the engine, and no second process touches the tokens. Whatever
names no model that way (listings, aliases, TGI's routes, LMTP's websockets, AICI) goes to the
gateway application, which reaches the same replicas through their deployment handle and the
engine channel, as for any model in an application of its own.

Serve config: ``route_prefix: /model/<name>`` (``gateway.model_routes``; HAProxy learns the model's
name from it) and ``import_path: gateway.app:build_model_app`` with args ``model`` (the model's
entry) and ``gateway`` (the settings the gateway application has: API keys, protocols, limits).
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from ray import serve

from engines.caller.routing import routing_options
from engines.kit.config import ModelConfig
from engines.replica.deployment import EngineReplica
from gateway.config import GatewayConfig, load_config
from gateway.ingress.bounds import BoundedEngine
from gateway.ingress.limits import REPLICA_HEADER, ResponseHeader
from gateway.ingress.local_engine import LocalEngineClient
from gateway.ingress.registry import ModelRegistry
from gateway.model_replica.router import with_ingress_router
from gateway.model_routes import engine_deployment

__all__ = ["ModelAppArgs", "ModelIngress", "load_model_app", "model_deployment"]


class ModelAppArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``build_model_app``'s args: the model's entry and the gateway's settings (a
    :class:`~gateway.config.GatewayConfig` mapping without ``models``; aliases and ``tgi_model``
    naming other models are left to the gateway application)."""

    model: ModelConfig
    gateway: dict[str, Any] = {}


def load_model_app(args: dict[str, Any] | ModelAppArgs) -> tuple[ModelConfig, GatewayConfig]:
    """The model and the gateway configuration its replicas serve it with."""
    if not isinstance(args, ModelAppArgs):
        try:
            args = msgspec.convert(args or {}, ModelAppArgs)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid model application config: {exc}") from None
    if "models" in args.gateway:
        raise ValueError("a model application's `gateway` settings list no models: its model "
                         "is `model`")
    name = args.model.name
    settings = {**args.gateway, "models": [msgspec.to_builtins(args.model)],
                "aliases": {alias: target for alias, target
                            in dict(args.gateway.get("aliases") or {}).items() if target == name}}
    if args.gateway.get("tgi_model") not in (None, name, *settings["aliases"]):
        settings["tgi_model"] = None
    return args.model, load_config(settings)


@serve.deployment(health_check_timeout_s=60)
@serve.ingress()
class ModelIngress(EngineReplica):
    """An engine replica (the handle methods the gateway application calls) that also serves
    its model over HTTP, with the engine in this process (``gateway.ingress.local_engine``)."""

    def __init__(self, model: ModelConfig, config: GatewayConfig):
        super().__init__(model)
        # What one replica holds plus its queue: beyond it, refused in the protocol's shape.
        pending = None if model.queue_limit() < 0 else model.ongoing_limit() + model.queue_limit()
        client = BoundedEngine(LocalEngineClient(self.host, model.name,
                                                 on_request=self.note_request),
                               model.name, max_pending=pending,
                               request_timeout_s=config.request_timeout_s)
        self._registry = ModelRegistry({model.name: client}, config.aliases,
                                       expose_paths=config.expose_model_paths,
                                       adapters=config.adapter_catalogs())
        self._config = config

    def __serve_build_asgi_app__(self) -> FastAPI:
        from gateway.ingress.asgi import serve_asgi_app

        app = serve_asgi_app(self._registry, self._config, capacity=None)
        app.add_middleware(ResponseHeader, name=REPLICA_HEADER,
                           value=serve.get_replica_context().replica_id.unique_id)
        return app


def model_deployment(model: ModelConfig, config: GatewayConfig) -> serve.Application:
    """The model's application: :class:`ModelIngress` replicas under the engine deployment's
    name (the gateway application's handle finds them by it), routed by prefix where it has
    several (docs/routing.md)."""
    app = ModelIngress.options(
        name=engine_deployment(model.name),
        # Serve refuses beyond these in plain text (direct ingress): set above the bounds that
        # refuse in the protocol's shape (the HTTP admission, the engine's pending bound).
        max_ongoing_requests=config.max_ongoing_requests,
        health_check_period_s=model.health_check_period_s,
        max_surge_percent=100,
        ray_actor_options=model.actor_options(),
        **model.replica_options(),
        **routing_options(model),
    ).bind(model, config)
    return with_ingress_router(app, model)

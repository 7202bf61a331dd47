"""How a batch host is put together: in a cluster (the batch actor's, over the engines' Serve
deployments) or in a process over given engines (tests). docs/protocols/batches.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from gateway.cluster.batches.runner import Send
from gateway.cluster.batches.service import ACTOR_NAME, NAMESPACE, BatchHost, app_sender
from gateway.cluster.batches.store import BatchStore
from gateway.ingress.meter import LedgerPort, MeteredEngine, TenantMeter
from gateway.ingress.registry import ModelRegistry

__all__ = ["batch_sender", "cluster_host", "store_for"]

MIB = 1024 * 1024


def store_for(config: Any, root: str | Path | None = None) -> BatchStore:
    """The store under ``root`` (default: the config's state directory)."""
    return BatchStore(Path(root or config.state_path) / "batches",
                      max_file_bytes=config.batch_max_file_mib * MIB,
                      max_lines=config.batch_max_lines)


def batch_sender(registry: ModelRegistry, config: Any, ledger: LedgerPort,
                 **app_options: Any) -> Send:
    """Lines sent through a gateway app of the batch host's own: no keys at its door (each
    line runs as its batch's owner), its engines metered to the owner's usage."""
    from gateway.ingress.asgi import create_app

    meter = TenantMeter(ledger)
    metered = registry.with_engines(
        lambda name, engine: MeteredEngine(engine, model=name, meter=meter))
    open_config = msgspec.structs.replace(config, api_keys=[], api_key=None, admin_key=None)
    return app_sender(create_app(metered, open_config, ledger=ledger, **app_options))


def cluster_host(config: Any, app_name: str) -> BatchHost:
    """The batch actor's host: every model the gateway application reaches by handle (a
    colocated model lives inside an ingress replica: batches cannot reach it)."""
    from ray import serve

    from gateway.cluster.ledger_actor import RayLedger
    from gateway.cluster.response_store import RayResponseStore
    from gateway.ingress.bounds import BoundedEngine
    from gateway.ingress.engine_client import ServeEngineClient
    from gateway.model_routes import engine_deployment

    clients = {}
    for model in config.models:
        if model.colocated:
            continue
        handle = serve.get_deployment_handle(engine_deployment(model.name),
                                             app_name=model.app or app_name, _check_exists=False)
        client = ServeEngineClient(
            handle, model.name, stall_timeout_s=config.engine_stall_timeout_s,
            caller=(ACTOR_NAME, NAMESPACE))  # not a Serve replica: named for the engine's watch
        clients[model.name] = BoundedEngine(client, model.name, max_pending=model.pending_limit(),
                                            request_timeout_s=config.request_timeout_s)
    registry = ModelRegistry(
        clients, {alias: to for alias, to in config.aliases.items() if to in clients},
        adapters={n: c for n, c in config.adapter_catalogs().items() if n in clients})
    send = batch_sender(registry, config, RayLedger(config.state_path),
                        response_store=RayResponseStore(config.stored_responses_bytes))
    return BatchHost(store_for(config), send, config.batch_concurrency)

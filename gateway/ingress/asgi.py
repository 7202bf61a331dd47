"""The HTTP ingress: a FastAPI app mounting the enabled protocols, in every process that
answers HTTP (the gateway's ingress replicas, and each replica of a model's own application).

``create_app(registry, config)`` builds the ASGI app over any engines (tests pass fakes);
``GatewayIngress`` is the gateway's Serve ingress around it (``gateway.app`` builds the
applications). Protocols are plug-ins (``protocols.catalog``): the app mounts each enabled
protocol's routers and lets the protocol that owns a path render route-level errors in its own
shape.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from contract import EngineUnavailable, InvalidPrompt
from contract.client import EngineClient
from gateway.cluster.batches.service import KeyScopedBatches, LocalBatches, RayBatches
from gateway.cluster.ledger_actor import LocalLedger
from gateway.cluster.response_store import RayResponseStore
from gateway.config import GatewayConfig
from gateway.ingress.bounds import BoundedEngine, CloseStreamsWithRequest
from gateway.ingress.keys import KeyAuth, KeyScopedStore
from gateway.ingress.limits import Admission, BodySizeLimit, CapacityHeader, route_path
from gateway.ingress.meter import LedgerPort, MeteredEngine, TenantMeter
from gateway.ingress.metrics import render_metrics
from gateway.ingress.registry import ModelRegistry
from gateway.ingress.telemetry import (
    GatewayMetrics,
    InstrumentedEngine,
    RequestTelemetry,
    current_record,
    gateway_metrics,
)
from gateway.ingress.tenant_routes import tenancy_router
from gateway.model_routes import engine_deployment
from gateway.shapes import ErrorShapes
from protocols.catalog import load_spec
from protocols.errors import ProtocolError
from protocols.responses.store import MemoryStore, ResponseStore

__all__ = ["GatewayIngress", "create_app", "serve_asgi_app"]

log = logging.getLogger(__name__)

# Probes and metrics answer without the API key (protocols add their own probes).
# Open even with an API key: probes. Metrics are not (they name models and count traffic);
# Prometheus scrapes them with `authorization: {credentials: <key>}`.
_PUBLIC_PATHS = frozenset({"/health", "/version"})
VERSION = "0.1.0"


def create_app(registry: ModelRegistry, config: GatewayConfig | None = None, *,
               metrics: GatewayMetrics | None = None, answer_ids: bool = True,
               response_store: ResponseStore | None = None,
               ledger: LedgerPort | None = None,
               batches: LocalBatches | RayBatches | None = None) -> FastAPI:
    """``metrics``: where the request series go (default: Ray's metrics system);
    ``answer_ids``: add ``x-request-id`` to responses (Serve adds it to a replica's);
    ``response_store``: the Responses API's stored responses (default: in this process; a
    Serve replica's are the cluster's, ``serve_asgi_app``); ``ledger``: the tenants' limits
    and usage (default: in this process; the cluster's in a Serve replica); ``batches``: where
    the Batch API's files and batches live (None: the API answers 404)."""
    config = config or GatewayConfig()
    metrics = metrics or gateway_metrics()
    meter = TenantMeter(ledger or LocalLedger(), metrics=metrics) if config.tenancy else None
    registry = registry.with_engines(_serving_stack(config, metrics, meter))
    specs = [load_spec(name) for name in config.protocols]
    errors = ErrorShapes(specs)
    app = FastAPI(title="llm-gateway", version=VERSION, docs_url=None, redoc_url=None)
    app.state.registry = registry
    app.state.meter = meter
    app.state.batches = KeyScopedBatches(batches) if batches is not None else None
    size = config.stored_responses_bytes
    app.state.response_store = KeyScopedStore(response_store or MemoryStore(size)) if size \
        else None
    # Each protocol's own options, built once (protocols.spec.options_of reads them).
    app.state.protocol_options = {spec.options: config.options_for(spec.options)
                                  for spec in specs if spec.options is not None}
    _add_middlewares(app, config, errors, _PUBLIC_PATHS.union(*(s.public_paths for s in specs)),
                     meter)
    owners = {route.endpoint: spec.name for spec in specs for router in spec.routers
              for route in router.routes}
    # Outermost: every response (refusals by the other middlewares too) gets its request id.
    app.add_middleware(RequestTelemetry, metrics=metrics, owners=owners, answer_ids=answer_ids)
    _add_error_handlers(app, errors)
    _add_own_routes(app, registry, specs)
    app.include_router(tenancy_router(frozenset(k.name for k in config.keys() if k.name)))
    for spec in specs:
        for router in spec.routers:
            app.include_router(router)
    return app


def _serving_stack(config: GatewayConfig, metrics: GatewayMetrics, meter: TenantMeter | None,
                   ) -> Callable[[str, EngineClient], EngineClient]:
    """Each model's engine client as the routes call it, outermost first: measured
    (``InstrumentedEngine``: the request series), metered (``MeteredEngine``: a key's limits
    and usage, with tenancy on), then what the registry was built with: the process's bounds
    (``BoundedEngine``) around the Serve or in-process client. An adapter's name resolves to
    this stack run with the adapter (``AdapterEngine``, outermost)."""
    kinds = {model.name: model.engine for model in config.models}

    def wrap(name: str, engine: EngineClient) -> EngineClient:
        if meter is not None:
            engine = MeteredEngine(engine, model=name, meter=meter)
        return InstrumentedEngine(engine, model=name, engine=kinds.get(name, "unknown"),
                                  metrics=metrics)

    return wrap


def _add_middlewares(app: FastAPI, config: GatewayConfig, errors: ErrorShapes,
                     public: frozenset[str], meter: TenantMeter | None) -> None:
    """Closing a request's generations, the body bound, admission and (with keys) auth; the
    last added runs first."""
    app.add_middleware(CloseStreamsWithRequest)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(Admission, max_inflight=config.max_concurrent_requests,
                       refuse=errors.response, exempt=public)
    if meter is not None:
        app.add_middleware(KeyAuth, keys=config.keys(), refuse=errors.response, public=public,
                           meter=meter, admin_key=config.admin_key,
                           protocol_of=lambda path: getattr(errors.owner(path), "name", None))


def _add_error_handlers(app: FastAPI, errors: ErrorShapes) -> None:
    """Every error becomes the owning protocol's shape, never exception text."""

    @app.exception_handler(ProtocolError)
    async def _protocol_error(_: Request, exc: ProtocolError) -> Response:
        return exc.response()

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, exc: EngineUnavailable) -> Response:
        return errors.response(route_path(request.scope), 503, str(exc))

    @app.exception_handler(InvalidPrompt)
    async def _invalid_prompt(request: Request, exc: InvalidPrompt) -> Response:
        return errors.response(route_path(request.scope), 400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # Unknown route, wrong method, body too large.
        return errors.response(route_path(request.scope), exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        where = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', 'invalid')}"
                          for e in exc.errors())
        return errors.response(route_path(request.scope), 400, f"invalid request: {where}")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # No exception text for the client (docs/reliability.md): an id to find it in the log.
        record = current_record()
        incident = record.request_id if record is not None else uuid.uuid4().hex[:12]
        log.exception("unhandled error (incident %s) on %s", incident, request.url.path)
        return errors.response(route_path(request.scope), 500,
                               f"internal error (incident {incident}; the gateway's log has "
                               "the details)")


def _add_own_routes(app: FastAPI, registry: ModelRegistry, specs: list) -> None:
    """The gateway's own paths: probes, metrics, engine stats and the listing at ``/``."""

    @app.get("/health")
    async def health() -> Response:
        failed = [n for n, ok in (await registry.health()).items() if not ok]
        if failed:
            return JSONResponse({"unhealthy": failed}, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    @app.get("/server/metrics")  # DJL Serving's path
    async def metrics() -> PlainTextResponse:
        body, content_type = render_metrics()
        return PlainTextResponse(body, media_type=content_type)

    @app.get("/gateway/engines")
    async def engine_stats() -> dict:
        """Per-model in-flight / aborted request counts, from the engine replicas."""
        served = registry.items()
        stats = await asyncio.gather(*(e.stats() for _, e in served))
        return {n: msgspec.structs.asdict(s) for (n, _), s in zip(served, stats, strict=True)}

    @app.get("/")
    async def root() -> dict:
        """What is served here (websocket upgrades on ``/`` are LMTP)."""
        return {"service": "llm-gateway", "version": VERSION, "models": registry.names(),
                "protocols": {s.name: s.listing for s in specs}}


@serve.deployment
@serve.ingress()
class GatewayIngress:
    """Serve ingress: the FastAPI app over one engine deployment handle per model."""

    def __init__(self, engines: dict[str, DeploymentHandle], config: GatewayConfig):
        from engines.replica.serve_logs import log_with_serve
        from gateway.ingress.engine_client import ServeEngineClient
        from gateway.ingress.local_engine import LocalEngineClient

        log_with_serve()
        handles = dict(engines)
        for model in config.models:
            if model.app is not None:
                # Its application may still be deploying (Serve deploys a config's applications
                # side by side): the handle must not insist that it exists yet.
                handles[model.name] = serve.get_deployment_handle(
                    engine_deployment(model.name), app_name=model.app, _check_exists=False)
        channel = _channel_receiver() if config.engine_transport == "channel" else None
        clients = {n: ServeEngineClient(h, n, stall_timeout_s=config.engine_stall_timeout_s,
                                        channel=channel)
                   for n, h in handles.items()}
        for model in config.models:
            if model.colocated:
                clients[model.name] = LocalEngineClient.start(model)
        clients = {m.name: BoundedEngine(clients[m.name], m.name, max_pending=m.pending_limit(),
                                         request_timeout_s=config.request_timeout_s)
                   for m in config.models}  # the config's order
        limits = [model.pending_limit() for model in config.models]
        self._capacity = None if None in limits else sum(limits)
        self._registry = ModelRegistry(clients, config.aliases,
                                       expose_paths=config.expose_model_paths,
                                       adapters=config.adapter_catalogs())
        self._config = config

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Batches are the gateway application's (its config names every model).
        batches = RayBatches(self._config, serve.get_replica_context().app_name)
        return serve_asgi_app(self._registry, self._config, self._capacity, batches)


def serve_asgi_app(registry: ModelRegistry, config: GatewayConfig, capacity: int | None,
                   batches: RayBatches | None = None) -> FastAPI:
    """The app a Serve replica serves (the gateway's ingress, a model's own application):
    ``capacity``, the generations it admits, is told to Serve's proxy in a header."""
    from gateway.cluster.ledger_actor import RayLedger
    from gateway.cluster.tag_store import SharedTagStore

    stored = RayResponseStore(config.stored_responses_bytes)
    ledger = RayLedger(config.state_path) if config.tenancy else None
    app = create_app(registry, config, answer_ids=False, response_store=stored, ledger=ledger,
                     batches=batches)
    # For Serve's proxy (gateway.edge.proxy), which takes it off; HAProxy would pass it on.
    if capacity is not None and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        app.add_middleware(CapacityHeader, capacity=capacity)
    if "aici" in config.protocols:
        app.state.aici_tags = SharedTagStore(serve.get_replica_context().app_name)
    return app


def _channel_receiver():
    """This ingress replica's end of the engines' token channel, on the node's address (engine
    replicas on other nodes connect to it)."""
    import ray

    from engines.channel import ChannelReceiver

    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    return ChannelReceiver(host)

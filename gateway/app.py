"""The gateway: a FastAPI app mounting every protocol, served by a Ray Serve ingress.

``create_app(registry, config)`` builds the ASGI app over any engines (tests pass fakes);
``build_app(args)`` is the ``serve run`` entry point that wires real vLLM deployments to it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.config import GatewayConfig, load_config
from gateway.limits import BodySizeLimit
from gateway.metrics import MetricsMiddleware, render_metrics
from gateway.registry import ModelRegistry
from protocols.lmi.errors import LMIError, TGIError, frontend_error
from protocols.lmi.routes import router as lmi_router
from protocols.lmi.tgi import router as tgi_router
from protocols.lmtp.routes import router as lmtp_router
from protocols.mindie.errors import VALIDATION as MINDIE_VALIDATION
from protocols.mindie.errors import MindIEError
from protocols.mindie.routes import router as mindie_router
from protocols.openai.errors import OpenAIError, error_body, error_response
from protocols.openai.routes import router as openai_router

__all__ = ["GatewayIngress", "build_app", "create_app"]

log = logging.getLogger(__name__)

_PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/server/metrics"})
VERSION = "0.1.0"
_LMI_PATHS = ("/invocations", "/predictions/", "/models/")
_LMI_ERROR_TYPES = {404: "ResourceNotFoundException", 405: "MethodNotAllowedException"}
_TGI_PATHS = frozenset({"/", "/generate", "/generate_stream", "/info"})
_MINDIE_ERROR_TYPES = {404: "NotFoundError", 405: "MethodNotAllowed"}


class _BearerAuth:
    """Pure ASGI middleware: ``Authorization: Bearer <key>`` on every route but the probes."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in _PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if headers.get(b"authorization") == self.expected:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # refuse the upgrade (HTTP 403)
            return await send({"type": "websocket.close", "code": 1008})
        response = JSONResponse(error_body(401, "invalid or missing API key"), status_code=401)
        return await response(scope, receive, send)


def create_app(registry: ModelRegistry, config: GatewayConfig | None = None) -> FastAPI:
    config = config or GatewayConfig()
    app = FastAPI(title="llm-gateway", version=VERSION, docs_url=None, redoc_url=None)
    app.state.registry = registry
    app.state.config = config
    app.state.mindie_full_text = config.mindie_full_text
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(MetricsMiddleware)
    if config.api_key:
        app.add_middleware(_BearerAuth, api_key=config.api_key)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(MindIEError)
    @app.exception_handler(LMIError)
    @app.exception_handler(TGIError)
    async def _protocol_error(_: Request, exc: MindIEError | LMIError | TGIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Route-level errors (unknown route, wrong method, body too large) in the shape of the
        # protocol the path belongs to; OpenAI's envelope elsewhere.
        status, detail = exc.status_code, str(exc.detail)
        path = request.url.path
        if path.startswith(_LMI_PATHS):
            return frontend_error(status, _LMI_ERROR_TYPES.get(status, "ServiceException"),
                                  detail).response()
        if path in _TGI_PATHS:
            return TGIError(status, detail, "validation" if status < 500 else "generation"
                            ).response()
        if path.startswith("/v2/"):
            return MindIEError(status, detail,
                               _MINDIE_ERROR_TYPES.get(status, MINDIE_VALIDATION)).response()
        return JSONResponse(error_body(status, detail), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc.errors())), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        served = registry.items()
        results = await asyncio.gather(*(e.check_health() for _, e in served),
                                       return_exceptions=True)
        failed = [n for (n, _), r in zip(served, results, strict=True)
                  if isinstance(r, BaseException)]
        if failed:
            return JSONResponse({"unhealthy": failed}, status_code=503)
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> JSONResponse:
        """SageMaker's health check: 200 when every model answers, else 500; a status map."""
        served = registry.items()
        results = await asyncio.gather(*(e.check_health() for _, e in served),
                                       return_exceptions=True)
        status = {n: "Unhealthy" if isinstance(r, BaseException) else "Healthy"
                  for (n, _), r in zip(served, results, strict=True)}
        healthy = all(v == "Healthy" for v in status.values())
        return JSONResponse(status, status_code=200 if healthy else 500)

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
        out = {}
        for name, engine in registry.items():
            stats = getattr(engine, "stats", None)
            out[name] = await stats() if stats else {}
        return out

    @app.get("/")
    async def root() -> dict:
        """What is served here (websocket upgrades on ``/`` are LMTP)."""
        return {"service": "llm-gateway", "version": VERSION, "models": registry.names(),
                "protocols": {"openai": "/v1", "lmtp": "ws:///  or  ws:///lmtp",
                              "mindie": "/v2/models/{model}/generate[_stream]",
                              "lmi": "/invocations  /predictions/{model}",
                              "tgi": "POST /  /generate  /generate_stream"}}

    app.include_router(openai_router)
    app.include_router(lmtp_router)
    app.include_router(mindie_router)
    app.include_router(lmi_router)
    app.include_router(tgi_router)
    return app


@serve.deployment
@serve.ingress()
class GatewayIngress:
    """Serve ingress: the FastAPI app over one ``VLLMDeployment`` handle per model."""

    def __init__(self, engines: dict[str, DeploymentHandle], config: GatewayConfig):
        from gateway.engine_client import ServeEngineClient

        self._registry = ModelRegistry({n: ServeEngineClient(h) for n, h in engines.items()},
                                       config.aliases)
        self._config = config

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self._registry, self._config)


def build_app(args: dict[str, Any] | GatewayConfig | None = None) -> serve.Application:
    """``serve run gateway.app:build_app`` entry point (args: a :class:`GatewayConfig` mapping)."""
    from engines.deployment import VLLMDeployment

    config = load_config(args)
    engines = {
        model.name: VLLMDeployment.options(
            name=f"engine-{model.name}",
            num_replicas=model.num_replicas,
            max_ongoing_requests=model.max_ongoing_requests,
            ray_actor_options={"num_cpus": model.num_cpus, "num_gpus": model.num_gpus},
        ).bind(model)
        for model in config.models
    }
    return GatewayIngress.options(
        num_replicas=config.ingress_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
    ).bind(engines, config)

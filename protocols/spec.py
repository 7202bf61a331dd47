"""What a protocol package hands the gateway: one :class:`ProtocolSpec` (its ``spec.SPEC``).

The gateway mounts the routers of every enabled protocol (in the configured order) and asks
the spec that owns a path to render route-level errors (unknown route, wrong method, body too
large, missing API key, unexpected failure) in that protocol's shape. Protocol routes find the
served models at ``app.state.registry`` (a :class:`contract.ModelDirectory`) and the
protocol's own options (its ``options`` type, built by the gateway from its configuration) with
:func:`options_of`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter
from starlette.requests import HTTPConnection
from starlette.responses import Response

__all__ = ["ProtocolSpec", "options_of"]

Options = TypeVar("Options")


@dataclass(frozen=True)
class ProtocolSpec:
    name: str
    routers: tuple[APIRouter, ...]
    listing: str  # where clients find it, for the gateway's root listing
    # HTTP-level error on a path this protocol owns → a response in its shape. ``None`` for a
    # protocol without HTTP routes of its own (LMTP: its errors are websocket messages).
    route_error: Callable[[int, str], Response] | None = None
    # The paths whose route-level errors are this protocol's: exact paths and path prefixes.
    paths: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    # Probes that must answer without the gateway's API key (SageMaker's /ping).
    public_paths: frozenset[str] = frozenset()
    # The options its routes read: a msgspec Struct whose fields name (``msgspec.field(name=)``)
    # the gateway configuration's key for each, so the gateway builds it from its configuration
    # (``GatewayConfig.options_for``) and the routes get it with :func:`options_of`.
    options: type | None = None
    # Where a request names its model, so that HAProxy can send it straight to the model's own
    # application (docs/cluster.md, "The default layout"): POST paths whose JSON body names
    # it in a top-level ``model``, and path prefixes followed by the model's name as the next
    # path segment. Requests named neither way take the gateway application's route.
    model_in_body: frozenset[str] = frozenset()
    model_in_path: tuple[str, ...] = ()

    def match(self, path: str) -> int:
        """How specifically this protocol owns ``path`` (0: not at all): an exact path beats
        any prefix, a longer prefix a shorter one (AICI's /v1/run inside OpenAI's /v1/)."""
        if self.route_error is None:
            return 0
        if path in self.paths:
            return 1 << 16
        return max((len(p) for p in self.prefixes if path.startswith(p)), default=0)


def options_of(connection: HTTPConnection, kind: type[Options]) -> Options:
    """The options of type ``kind`` the gateway built for the app serving ``connection`` (a
    request or a websocket)."""
    options: dict[type, Any] = connection.app.state.protocol_options
    return options[kind]

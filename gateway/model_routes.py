"""Where a model's own application is found: its route prefix and its replicas' deployment
(``gateway.model_replica.ingress``). Light on purpose: HAProxy's launcher and Serve's proxy read it."""

from __future__ import annotations

__all__ = ["MODEL_ROUTE", "engine_deployment", "model_of_route", "model_route"]

# Route prefixes of models' own applications; HAProxy reads the model's name after it.
MODEL_ROUTE = "/model/"


def model_route(name: str) -> str:
    """The route prefix of model ``name``'s own application (also a base URL for it alone)."""
    return MODEL_ROUTE + name


def model_of_route(prefix: str) -> str | None:
    """The model whose own application has route prefix ``prefix`` (None: not a model's)."""
    prefix = prefix.rstrip("/")
    return prefix[len(MODEL_ROUTE):] or None if prefix.startswith(MODEL_ROUTE) else None


def engine_deployment(name: str) -> str:
    """The deployment of model ``name``'s engine replicas, in whichever application."""
    return f"engine-{name}"

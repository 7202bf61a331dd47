"""The gateway's tenancy routes (docs/tenancy.md, "Usage" and "The admin API").

``GET /gateway/usage``: the calling key's usage per UTC day, model and protocol.
Behind the admin key (``admin_key``): ``GET /gateway/admin/usage`` (every key's),
``GET /gateway/admin/keys``, ``POST /gateway/admin/keys`` (answers the new key, once; only its
digest is kept), ``DELETE /gateway/admin/keys/{name}``.
"""

from __future__ import annotations

import re
import secrets

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from gateway.cluster.ledger import KeyRecord
from gateway.ingress.keys import KeyPolicy, current_key, key_id
from gateway.ingress.meter import TenantMeter

__all__ = ["tenancy_router"]

_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")


def _meter(request: Request) -> TenantMeter:
    meter = getattr(request.app.state, "meter", None)
    if meter is None:
        raise HTTPException(404, "this gateway has no API keys: no usage is kept")
    return meter


def _days(since: str | None, until: str | None) -> tuple[str, str]:
    for value in (since, until):
        if value is not None and not _DAY.fullmatch(value):
            raise HTTPException(400, f"dates are YYYY-MM-DD (UTC), got {value!r}")
    return since or "", until or "9999-12-31"


def _listing(rows: list) -> dict:
    return {"object": "list", "data": msgspec.to_builtins(rows)}


def tenancy_router(config_names: frozenset[str]) -> APIRouter:
    """``config_names``: the config's key names, which the admin API may not take."""
    router = APIRouter()

    @router.get("/gateway/usage")
    async def own_usage(request: Request, since: str | None = None,
                        until: str | None = None) -> dict:
        meter, state = _meter(request), current_key.get()
        if state is None:
            raise HTTPException(401, "usage is per API key: send one")
        await meter.flush()  # this process's own counts first
        return _listing(await meter.ledger.usage(state.owner, *_days(since, until)))

    @router.get("/gateway/admin/usage")
    async def all_usage(request: Request, since: str | None = None, until: str | None = None,
                        key: str | None = None) -> dict:
        meter = _meter(request)
        await meter.flush()
        rows = await meter.ledger.usage(None, *_days(since, until))
        return _listing([r for r in rows if key is None or r.key == key])

    @router.get("/gateway/admin/keys")
    async def list_keys(request: Request) -> dict:
        records = await _meter(request).ledger.keys()
        return {"object": "list", "data": [{"name": n, **r.policy} for n, r in records.items()]}

    @router.post("/gateway/admin/keys")
    async def make_key(request: Request) -> Response:
        meter = _meter(request)
        try:
            policy = msgspec.json.decode(await request.body(), type=KeyPolicy)
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
            raise HTTPException(400, f"invalid key policy: {exc}") from None
        if not policy.name:
            raise HTTPException(400, "a key needs a name")
        if policy.name in config_names or policy.name in await meter.ledger.keys():
            raise HTTPException(409, f"a key named {policy.name!r} exists")
        secret = "sk-gw-" + secrets.token_urlsafe(32)
        await meter.ledger.put_key(policy.name, KeyRecord(
            digest=key_id(secret.encode()), policy=msgspec.to_builtins(policy)))
        return JSONResponse({"key": secret, **msgspec.to_builtins(policy)}, status_code=201)

    @router.delete("/gateway/admin/keys/{name}")
    async def delete_key(request: Request, name: str) -> dict:
        if not await _meter(request).ledger.delete_key(name):
            raise HTTPException(404, f"no key named {name!r} was made through this API")
        return {"name": name, "deleted": True}

    return router

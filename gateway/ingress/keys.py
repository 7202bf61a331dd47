"""API keys: who may call, what each key may do, and the admin key that manages keys
(docs/tenancy.md).

:class:`KeyAuth` is the ASGI middleware that checks the key on every route but the probes
(``Authorization: Bearer <key>``, any case of the scheme, ``api-key: <key>`` or Anthropic's
``x-api-key: <key>``; websockets may give ``?api_key=`` instead, because LMQL's LMTP client
sends no headers). A key with limits is admitted by the cluster's ledger
(``gateway.ingress.meter``, ``gateway.cluster.ledger``): refused with 429, ``Retry-After`` and
the protocol's rate-limit headers, or admitted holding a concurrency slot until its response
ends. The caller's
:class:`~gateway.ingress.meter.KeyState` is then the current one for the request; the engines'
``MeteredEngine`` holds its generations to the key's models, tier and token limits.

Keys come from the config (``api_keys``, ``api_key``) and from the admin API (``admin_key``;
``gateway.ingress.tenant_routes``), which stores only a key's digest in the ledger; the ones made there
are seen by every replica within :data:`REFRESH_S`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from typing import Literal
from urllib.parse import parse_qs

import msgspec

from gateway.cluster.ledger import Grant, KeyRecord, Limits
from gateway.ingress.limits import route_path
from gateway.ingress.meter import BATCH_TIER, KeyState, TenantMeter, current_key
from gateway.ingress.telemetry import refused_for
from protocols.responses.store import ResponseStore, StoredResponse

__all__ = ["ADMIN_PREFIX", "ApiKey", "KeyAuth", "KeyPolicy", "KeyScopedStore", "current_key",
           "key_id", "key_state"]

ADMIN_PREFIX = "/gateway/admin/"
REFRESH_S = 2.0  # keys made or deleted through the admin API take effect within this


class KeyPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one key may do. Every limit holds for the whole cluster (docs/tenancy.md)."""

    name: str = ""  # labels the key in usage and logs (the key itself is never logged)
    requests_per_s: float | None = None  # sustained rate; bursts up to max(1, rate)
    requests_per_min: int | None = None  # at most this many admitted in any 60 s
    tokens_per_min: float | None = None  # prompt + generated tokens in any 60 s
    max_concurrent: int | None = None  # requests (streams, websockets) in flight at once
    token_budget: int | None = None  # prompt + generated tokens per budget_period (UTC)
    budget_period: Literal["day", "month"] = "day"
    models: list[str] | None = None  # models and adapters it may use (None: all)
    tier: int = 1  # 0 is served first; batches run below every tier

    def __post_init__(self) -> None:
        for field in ("requests_per_s", "requests_per_min", "tokens_per_min", "max_concurrent",
                      "token_budget"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"{field} must be positive, got {value}")
        if not 0 <= self.tier < BATCH_TIER:
            raise ValueError(f"tier must be 0 to {BATCH_TIER - 1}, got {self.tier}")

    def limits(self) -> Limits:
        return Limits(requests_per_s=self.requests_per_s, requests_per_min=self.requests_per_min,
                      tokens_per_min=self.tokens_per_min, max_concurrent=self.max_concurrent,
                      token_budget=self.token_budget, budget_period=self.budget_period)


class ApiKey(KeyPolicy, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A key of the config: the key and its policy."""

    key: str

    def __post_init__(self) -> None:
        if not self.key.strip():
            raise ValueError("API keys must not be empty")
        super().__post_init__()


def key_id(secret: bytes) -> str:
    """A key's id: a digest, so no store ever holds the key itself."""
    return hashlib.sha256(b"llm-gateway owner\0" + secret).hexdigest()


def key_state(policy: KeyPolicy, owner: str) -> KeyState:
    return KeyState(owner=owner, name=policy.name or owner[:8], limits=policy.limits(),
                    models=None if policy.models is None else frozenset(policy.models),
                    tier=policy.tier)


class KeyAuth:
    """Pure ASGI middleware over the accepted keys (module docstring). ``refuse``: (path,
    status, message) → an ASGI response in the path's protocol shape; ``protocol_of``: path →
    the owning protocol's name (for its rate-limit headers)."""

    def __init__(self, app, keys: list[ApiKey], refuse, public: frozenset[str], *,
                 meter: TenantMeter, admin_key: str | None = None, protocol_of=None):
        self.app = app
        self.keys = [(k.key.encode(), key_state(k, key_id(k.key.encode()))) for k in keys]
        self.refuse = refuse
        self.public = public
        self.meter = meter
        self.admin = admin_key.encode() if admin_key else None
        self.protocol_of = protocol_of or (lambda _: None)
        self._made: dict[str, KeyState] = {}  # admin-made keys by id
        self._refreshed = -REFRESH_S
        self._refreshing: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or route_path(scope) in self.public:
            return await self.app(scope, receive, send)
        path = route_path(scope)
        presented = _presented(scope)
        if path.startswith(ADMIN_PREFIX):
            if self.admin is None or not any(hmac.compare_digest(p, self.admin)
                                             for p in presented):
                return await self._deny(scope, receive, send, 401, "invalid or missing admin key")
            return await self.app(scope, receive, send)
        state = await self._match(presented)
        if state is None:
            return await self._deny(scope, receive, send, 401, "invalid or missing API key")
        grant = await self.meter.admit(state)
        if grant is not None and not grant.admitted:
            refused_for("rate_limit")
            return await self._deny(scope, receive, send, 429, f"{grant.message}; retry in "
                                    f"{grant.retry_after_s} s", grant=grant)
        token = current_key.set(state)
        try:
            await self.app(scope, receive, self._with_headers(path, grant, send))
        finally:
            current_key.reset(token)
            self.meter.release(state, grant)

    async def _match(self, presented: list[bytes]) -> KeyState | None:
        found = None
        # Every config key is compared, in constant time, whatever matched: timing leaks
        # neither how much of a key matched nor which one.
        for candidate in presented:
            for secret, state in self.keys:
                if hmac.compare_digest(candidate, secret):
                    found = state
        if found is not None or self.admin is None:
            return found
        await self._refresh()
        ids = [key_id(candidate) for candidate in presented]
        return next((self._made[i] for i in ids if i in self._made), None)

    async def _refresh(self) -> None:
        """Read the admin-made keys again if the last read is REFRESH_S old: a key made or
        deleted takes effect within REFRESH_S; concurrent requests share one read."""
        if time.monotonic() - self._refreshed >= REFRESH_S and (
                self._refreshing is None or self._refreshing.done()):
            self._refreshed = time.monotonic()
            self._refreshing = asyncio.get_running_loop().create_task(self._read_keys())
        if self._refreshing is not None and not self._refreshing.done():
            await asyncio.shield(self._refreshing)

    async def _read_keys(self) -> None:
        try:
            records: dict[str, KeyRecord] = await self.meter.ledger.keys()
        except Exception:  # keep the keys known until the ledger answers
            return
        self._made = {r.digest: key_state(msgspec.convert(r.policy, KeyPolicy), r.digest)
                      for r in records.values()}

    def _with_headers(self, path: str, grant: Grant | None, send):
        headers = _rate_headers(self.protocol_of(path), grant)
        if not headers:
            return send

        async def sender(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*(message.get("headers") or ()), *headers]
            await send(message)
        return sender

    async def _deny(self, scope, receive, send, status: int, message: str,
                    grant: Grant | None = None):
        if scope["type"] == "websocket":  # refuse the upgrade (HTTP 403)
            return await send({"type": "websocket.close", "code": 1008})
        path = route_path(scope)
        response = self.refuse(path, status, message)
        if grant is not None:
            response.headers["retry-after"] = str(grant.retry_after_s)
            for name, value in _rate_headers(self.protocol_of(path), grant):
                response.headers[name.decode()] = value.decode()
        if status == 401:  # RFC 6750: which scheme to answer with
            response.headers["www-authenticate"] = 'Bearer realm="llm-gateway"'
        return await response(scope, receive, send)


def _presented(scope) -> list[bytes]:
    """The keys a request presents, in every place a client of some protocol puts one."""
    headers = dict(scope["headers"])
    scheme, _, credentials = headers.get(b"authorization", b"").strip().partition(b" ")
    presented = [credentials.strip()] if scheme.lower() == b"bearer" else []
    if b"api-key" in headers:  # AICI's pyaici (and Azure OpenAI's clients) send this
        presented.append(headers[b"api-key"].strip())
    if b"x-api-key" in headers:  # Anthropic's clients send this
        presented.append(headers[b"x-api-key"].strip())
    if scope["type"] == "websocket":
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        presented += [k.encode() for k in query.get("api_key", [])]
    return [p for p in presented if p]


def _rate_headers(protocol: str | None, grant: Grant | None) -> list[tuple[bytes, bytes]]:
    """The protocol's own rate-limit headers: OpenAI's ``x-ratelimit-*`` (durations),
    Anthropic's ``anthropic-ratelimit-*`` (RFC 3339 reset times); none for the others."""
    if grant is None or protocol not in ("openai", "responses", "anthropic"):
        return []
    headers = []
    for kind, view in (("requests", grant.requests), ("tokens", grant.tokens)):
        if view is None:
            continue
        if protocol == "anthropic":
            reset = time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                  time.gmtime(time.time() + view.reset_s))
            prefix = f"anthropic-ratelimit-{kind}-"
            headers += [(f"{prefix}limit", str(view.limit)),
                        (f"{prefix}remaining", str(view.remaining)), (f"{prefix}reset", reset)]
        else:
            headers += [(f"x-ratelimit-limit-{kind}", str(view.limit)),
                        (f"x-ratelimit-remaining-{kind}", str(view.remaining)),
                        (f"x-ratelimit-reset-{kind}", _duration(view.reset_s))]
    return [(name.encode(), value.encode()) for name, value in headers]


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``1m30s``, ``6s``, ``120ms``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


class KeyScopedStore:
    """Stored responses seen by the key that made them only, as OpenAI scopes them to their
    project (docs/protocols/responses.md, "Stored responses"): each is stored with its caller's
    key id, and another key's reads and deletes find nothing (404), whether or not it knows the
    id. Without keys every caller is the same one."""

    def __init__(self, inner: ResponseStore):
        self.inner = inner

    @staticmethod
    def _caller() -> str:
        state = current_key.get()
        return state.owner if state is not None else ""

    async def get(self, response_id: str) -> StoredResponse | None:
        stored = await self.inner.get(response_id)
        return stored if stored is not None and stored.owner == self._caller() else None

    async def put(self, stored: StoredResponse) -> bool:
        return await self.inner.put(msgspec.structs.replace(stored, owner=self._caller()))

    async def delete(self, response_id: str) -> bool:
        return await self.get(response_id) is not None and await self.inner.delete(response_id)

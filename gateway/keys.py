"""API keys: who may call, and how much (requests per second, tokens per minute, per key).

:class:`KeyAuth` is the ASGI middleware that checks the key on every route but the probes
(``Authorization: Bearer <key>``, any case of the scheme, ``api-key: <key>`` or Anthropic's
``x-api-key: <key>``; websockets may
give ``?api_key=`` instead, because LMQL's LMTP client sends no headers), refuses a key over
its request rate with 429, and makes the caller's :class:`KeyState` the current one for the
request. Token budgets are charged where the tokens are known: :class:`MeteredEngine` wraps
each model's engine, refuses a generation while the key's token bucket is empty, and charges
prompt plus completion tokens when it ends. Budgets are per ingress replica (N replicas admit
up to N times the rate).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import AsyncIterator
from contextvars import ContextVar
from urllib.parse import parse_qs

import msgspec

from gateway.limits import route_path
from gateway.registry import EngineWrapper
from gateway.telemetry import refused_for
from protocols.internal import ErrorEvent, Event, FinalEvent, GenerateRequest
from protocols.responses.store import ResponseStore, StoredResponse

__all__ = ["ApiKey", "KeyAuth", "KeyScopedStore", "KeyState", "MeteredEngine", "current_key"]


class ApiKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One accepted key. ``name`` labels it in logs (the key itself is never logged)."""

    key: str
    name: str = ""
    requests_per_s: float | None = None  # sustained rate; bursts up to max(1, rate)
    tokens_per_min: float | None = None  # prompt + completion tokens; bursts up to a minute's

    def __post_init__(self) -> None:
        if not self.key.strip():
            raise ValueError("API keys must not be empty")
        for field in ("requests_per_s", "tokens_per_min"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"{field} must be positive, got {value}")


class _Bucket:
    """A token bucket: ``capacity`` at most, refilled at ``rate`` per second; may go negative
    when charged after the fact (tokens), which then delays the next admission."""

    def __init__(self, rate: float, capacity: float):
        self.rate, self.capacity = rate, capacity
        self.level, self.stamp = capacity, time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def available(self) -> bool:
        self._refill()
        return self.level >= 1 if self.capacity >= 1 else self.level > 0

    def take(self, amount: float = 1.0) -> None:
        self._refill()
        self.level -= amount

    def wait_s(self) -> int:
        """Whole seconds until the bucket admits again (Retry-After)."""
        self._refill()
        missing = (1 if self.capacity >= 1 else 0) - self.level
        return max(1, math.ceil(missing / self.rate)) if missing > 0 else 1


class KeyState:
    def __init__(self, policy: ApiKey):
        self.policy = policy
        self.secret = policy.key.encode()
        # Who owns what this key stores: a digest, so no store ever holds the key itself.
        self.owner = hashlib.sha256(b"llm-gateway owner\0" + self.secret).hexdigest()
        rps, tpm = policy.requests_per_s, policy.tokens_per_min
        self.requests = _Bucket(rps, max(1.0, rps)) if rps else None
        self.tokens = _Bucket(tpm / 60.0, tpm) if tpm else None


current_key: ContextVar[KeyState | None] = ContextVar("current_key", default=None)


class KeyAuth:
    """Pure ASGI middleware over the accepted keys (module docstring)."""

    def __init__(self, app, keys: list[ApiKey], refuse, public: frozenset[str]):
        self.app = app
        self.keys = [KeyState(k) for k in keys]
        self.refuse = refuse  # (path, status, message) -> ASGI response
        self.public = public

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or route_path(scope) in self.public:
            return await self.app(scope, receive, send)
        state = self._match(scope)
        if state is None:
            return await self._deny(scope, receive, send, 401, "invalid or missing API key")
        if state.requests is not None:
            if not state.requests.available():
                wait = state.requests.wait_s()
                refused_for("rate_limit")
                return await self._deny(scope, receive, send, 429, (
                    f"rate limit of {state.policy.requests_per_s:g} requests/s exceeded for "
                    f"this key; retry in {wait} s"), retry_after=wait)
            state.requests.take()
        token = current_key.set(state)
        try:
            await self.app(scope, receive, send)
        finally:
            current_key.reset(token)

    def _match(self, scope) -> KeyState | None:
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
        found = None
        # Every key is compared, in constant time, whatever matched: timing leaks neither how
        # much of a key matched nor which one.
        for candidate in presented:
            for state in self.keys:
                if hmac.compare_digest(candidate, state.secret):
                    found = state
        return found

    async def _deny(self, scope, receive, send, status: int, message: str,
                    retry_after: int | None = None):
        if scope["type"] == "websocket":  # refuse the upgrade (HTTP 403)
            return await send({"type": "websocket.close", "code": 1008})
        response = self.refuse(route_path(scope), status, message)
        if retry_after is not None:
            response.headers["retry-after"] = str(retry_after)
        if status == 401:  # RFC 6750: which scheme to answer with
            response.headers["www-authenticate"] = 'Bearer realm="llm-gateway"'
        return await response(scope, receive, send)


class MeteredEngine(EngineWrapper):
    """An engine whose generations count against the calling key's token budget."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        state = current_key.get()
        bucket = state.tokens if state is not None else None
        if bucket is None:
            async for event in self.inner.generate(request):
                yield event
            return
        if not bucket.available():
            refused_for("rate_limit")
            yield ErrorEvent(kind="rate_limited", message=(
                f"token rate limit of {state.policy.tokens_per_min:g} tokens/min exceeded for "
                f"this key; retry in {bucket.wait_s()} s"))
            return
        prompt_charged = False
        async for event in self.inner.generate(request):
            if isinstance(event, FinalEvent):
                used = event.usage.completion_tokens
                if not prompt_charged:  # the prompt once, whatever the number of choices
                    used += event.usage.prompt_tokens
                    prompt_charged = True
                bucket.take(used)
            yield event


class KeyScopedStore:
    """Stored responses seen by the key that made them only, as OpenAI scopes them to their
    project (docs/protocols/responses.md, "Stored responses"): each is stored with its caller's
    :attr:`KeyState.owner`, and another key's reads and deletes find nothing (404), whether or
    not it knows the id. Without keys every caller is the same one."""

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

"""The cluster's ledger of tenants (docs/tenancy.md): what each key may still do now, and what
each key has used.

Limits are counted here, in one place for the whole cluster, so that N ingress replicas admit
what one would: requests per minute (a sliding window of admission times, exact), requests per
second (a token bucket), tokens per minute (a sliding window of per-second sums), concurrent
requests (slots held by a named holder, an ingress process, and dropped when its lease runs out),
and a token budget per day or month. Usage is kept per UTC day, key, model and protocol.

Plain Python, one thread: the cluster's instance lives in a named Ray actor
(``gateway.cluster.ledger_actor``); a gateway without Ray (unit tests) holds one in its process.
"""

from __future__ import annotations

import calendar
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

import msgspec

__all__ = ["LEASE_S", "Charge", "Grant", "KeyRecord", "Ledger", "Limits", "RateView",
           "UsageRow", "period_of"]

# A holder (an ingress process) that has not been heard from for this long has died: the
# concurrency slots it held are freed.
LEASE_S = 30.0
WINDOW_S = 60
# Usage older than this many days is dropped (a bound on the ledger's size).
USAGE_DAYS = 400

Reason = Literal["", "requests", "tokens", "concurrency", "budget"]


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """One key's limits as the ledger applies them (``gateway.ingress.keys.ApiKey`` declares them)."""

    requests_per_s: float | None = None
    requests_per_min: int | None = None
    tokens_per_min: float | None = None
    max_concurrent: int | None = None
    token_budget: int | None = None
    budget_period: Literal["day", "month"] = "day"

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.requests_per_s, self.requests_per_min,
                                           self.tokens_per_min, self.max_concurrent,
                                           self.token_budget))


class RateView(msgspec.Struct, frozen=True, kw_only=True):
    """A window's state for the client (OpenAI's ``x-ratelimit-*`` headers)."""

    limit: int
    remaining: int
    reset_s: float  # until the window holds nothing it holds now


class Grant(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to one admission: admitted (holding ``slot`` if the key has a concurrency
    limit) or refused for ``reason``, retry in ``retry_after_s``."""

    admitted: bool
    slot: int = 0  # 0: no slot held
    reason: Reason = ""
    message: str = ""
    retry_after_s: int = 0
    requests: RateView | None = None
    tokens: RateView | None = None


class Charge(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens a key used on one model through one protocol (a process sums its generations
    into one charge per flush)."""

    key: str  # the key's id (a digest, never the key)
    name: str  # the key's name, for listings
    model: str
    protocol: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens_per_min: float | None = None  # the key's limits, to answer whether it is blocked
    token_budget: int | None = None
    budget_period: Literal["day", "month"] = "day"


class UsageRow(msgspec.Struct, frozen=True, kw_only=True):
    day: str  # UTC, YYYY-MM-DD
    key: str  # the key's name
    model: str
    protocol: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


class KeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A key made through the admin API: its digest (the key itself is never kept) and its
    policy (``gateway.ingress.keys.ApiKey`` fields but ``key``)."""

    digest: str
    policy: dict


def period_of(now: float, period: Literal["day", "month"]) -> str:
    stamp = time.strftime("%Y-%m-%d", time.gmtime(now))
    return stamp if period == "day" else stamp[:7]


def _period_end(now: float, period: Literal["day", "month"]) -> float:
    if period == "day":
        return (math.floor(now / 86400) + 1) * 86400.0
    day = time.gmtime(now)
    year, month = (day.tm_year + 1, 1) if day.tm_mon == 12 else (day.tm_year, day.tm_mon + 1)
    return float(calendar.timegm((year, month, 1, 0, 0, 0)))


class _Bucket:
    def __init__(self, rate: float, now: float):
        self.rate, self.capacity = rate, max(1.0, rate)
        self.level, self.stamp = self.capacity, now

    def wait_s(self, now: float) -> float:
        """0 when a request may pass now (and refills the bucket to now)."""
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return 0.0 if self.level >= 1 else (1 - self.level) / self.rate


class _KeyWindows:
    """One key's rate state."""

    def __init__(self) -> None:
        self.admitted: deque[float] = deque()  # admission times in the last minute
        self.tokens: deque[list[int]] = deque()  # [second, tokens] in the last minute
        self.bucket: _Bucket | None = None
        self.slots: dict[int, str] = {}  # slot → holder

    def forget_before(self, now: float) -> None:
        while self.admitted and self.admitted[0] <= now - WINDOW_S:
            self.admitted.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.tokens.popleft()

    def token_sum(self) -> int:
        return sum(tokens for _, tokens in self.tokens)

    def add_tokens(self, now: float, count: int) -> None:
        second = int(now)
        if self.tokens and self.tokens[-1][0] == second:
            self.tokens[-1][1] += count
        else:
            self.tokens.append([second, count])

    def tokens_wait_s(self, now: float, limit: int) -> float:
        """Until the window's sum drops below ``limit``."""
        total, wait = self.token_sum(), 0.0
        for second, count in self.tokens:
            if total < limit:
                break
            total -= count
            wait = second + WINDOW_S - now
        return max(0.0, wait)


class Ledger:
    """The limits and usage of every key (module docstring). ``clock``: wall-clock seconds."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._windows: dict[str, _KeyWindows] = {}
        self._holders: dict[str, float] = {}  # holder → last heard from
        self._spent: dict[str, int] = {}  # "<key>/<period>" → tokens
        self._usage: dict[tuple[str, str, str, str], list] = {}  # (day, key, model, protocol)
        self._names: dict[str, str] = {}  # key id → name
        self.keys: dict[str, KeyRecord] = {}  # admin-made keys by name
        self._next_slot = 0
        self.changed = False  # usage or keys changed since the last snapshot

    # --- admission -----------------------------------------------------------------------------

    def admit(self, key: str, limits: Limits, holder: str) -> Grant:
        """Admit one request of ``key`` or say why not; taking nothing when refusing."""
        now = self.clock()
        self.renew(holder)
        self._expire(now)
        windows = self._windows.setdefault(key, _KeyWindows())
        windows.forget_before(now)
        refusal = (self._over_budget(key, limits, now) or self._over_concurrency(windows, limits)
                   or self._over_requests(windows, limits, now)
                   or self._over_tokens(windows, limits, now))
        if refusal is not None:
            reason, message, wait = refusal
            return Grant(admitted=False, reason=reason, message=message,
                         retry_after_s=max(1, math.ceil(wait)),
                         requests=self._requests_view(windows, limits, now),
                         tokens=self._tokens_view(windows, limits, now))
        windows.admitted.append(now)
        if windows.bucket is not None:
            windows.bucket.level -= 1
        slot = 0
        if limits.max_concurrent is not None:
            self._next_slot += 1
            slot = self._next_slot
            windows.slots[slot] = holder
        return Grant(admitted=True, slot=slot, requests=self._requests_view(windows, limits, now),
                     tokens=self._tokens_view(windows, limits, now))

    def release(self, key: str, slot: int) -> None:
        windows = self._windows.get(key)
        if windows is not None:
            windows.slots.pop(slot, None)

    def holders(self) -> list[str]:
        """The processes holding a lease (ingress replicas that admitted a request lately)."""
        return sorted(self._holders)

    def renew(self, holder: str) -> None:
        self._holders[holder] = self.clock()

    def _expire(self, now: float) -> None:
        gone = {h for h, seen in self._holders.items() if seen < now - LEASE_S}
        if not gone:
            return
        for holder in gone:
            del self._holders[holder]
        for windows in self._windows.values():
            for slot in [s for s, h in windows.slots.items() if h in gone]:
                del windows.slots[slot]

    def _over_budget(self, key: str, limits: Limits, now: float):
        if limits.token_budget is None:
            return None
        spent = self._spent.get(f"{key}/{period_of(now, limits.budget_period)}", 0)
        if spent < limits.token_budget:
            return None
        return ("budget", f"token budget of {limits.token_budget} tokens per "
                f"{limits.budget_period} spent for this key", _period_end(now, limits.budget_period) - now)

    @staticmethod
    def _over_concurrency(windows: _KeyWindows, limits: Limits):
        if limits.max_concurrent is None or len(windows.slots) < limits.max_concurrent:
            return None
        return ("concurrency", f"this key already has {limits.max_concurrent} requests in "
                "flight", 1.0)

    @staticmethod
    def _over_requests(windows: _KeyWindows, limits: Limits, now: float):
        rpm = limits.requests_per_min
        if rpm is not None and len(windows.admitted) >= rpm:
            wait = windows.admitted[len(windows.admitted) - rpm] + WINDOW_S - now
            return ("requests", f"rate limit of {rpm} requests/min exceeded for this key", wait)
        if limits.requests_per_s is not None:
            if windows.bucket is None or windows.bucket.rate != limits.requests_per_s:
                windows.bucket = _Bucket(limits.requests_per_s, now)
            wait = windows.bucket.wait_s(now)
            if wait > 0:
                return ("requests", f"rate limit of {limits.requests_per_s:g} requests/s "
                        "exceeded for this key", wait)
        return None

    @staticmethod
    def _over_tokens(windows: _KeyWindows, limits: Limits, now: float):
        tpm = limits.tokens_per_min
        if tpm is None or windows.token_sum() < tpm:
            return None
        return ("tokens", f"token rate limit of {tpm:g} tokens/min exceeded for this key",
                windows.tokens_wait_s(now, tpm))

    @staticmethod
    def _requests_view(windows: _KeyWindows, limits: Limits, now: float) -> RateView | None:
        rpm = limits.requests_per_min
        if rpm is None:
            return None
        reset = windows.admitted[-1] + WINDOW_S - now if windows.admitted else 0.0
        return RateView(limit=rpm, remaining=max(0, rpm - len(windows.admitted)), reset_s=reset)

    @staticmethod
    def _tokens_view(windows: _KeyWindows, limits: Limits, now: float) -> RateView | None:
        tpm = limits.tokens_per_min
        if tpm is None:
            return None
        reset = windows.tokens[-1][0] + WINDOW_S - now if windows.tokens else 0.0
        return RateView(limit=int(tpm), remaining=max(0, int(tpm - windows.token_sum())),
                        reset_s=max(0.0, reset))

    # --- usage ---------------------------------------------------------------------------------

    def charge(self, charges: list[Charge]) -> dict[str, tuple[int, str]]:
        """Count what keys used; answers, for each key now over its tokens per minute or its
        budget, the seconds until it may generate again and why."""
        now = self.clock()
        day = period_of(now, "day")
        blocked: dict[str, tuple[int, str]] = {}
        for charge in charges:
            tokens = charge.prompt_tokens + charge.completion_tokens
            self._names[charge.key] = charge.name
            row = self._usage.setdefault((day, charge.key, charge.model, charge.protocol),
                                         [0, 0, 0])
            row[0] += charge.requests
            row[1] += charge.prompt_tokens
            row[2] += charge.completion_tokens
            windows = self._windows.setdefault(charge.key, _KeyWindows())
            windows.forget_before(now)
            windows.add_tokens(now, tokens)
            limits = Limits(tokens_per_min=charge.tokens_per_min,
                            token_budget=charge.token_budget, budget_period=charge.budget_period)
            if limits.token_budget is not None:
                period = f"{charge.key}/{period_of(now, limits.budget_period)}"
                self._spent[period] = self._spent.get(period, 0) + tokens
            refusal = self._over_budget(charge.key, limits, now) or self._over_tokens(
                windows, limits, now)
            if refusal is not None:
                blocked[charge.key] = (max(1, math.ceil(refusal[2])), refusal[1])
        self.changed = self.changed or bool(charges)
        return blocked

    def usage(self, key: str | None = None, since: str = "", until: str = "9999") -> list[UsageRow]:
        """Usage rows (of one key id, or every key's), days ``since`` ≤ day ≤ ``until``."""
        return [UsageRow(day=day, key=self._names.get(owner, owner), model=model,
                         protocol=protocol, requests=row[0], prompt_tokens=row[1],
                         completion_tokens=row[2])
                for (day, owner, model, protocol), row in sorted(self._usage.items())
                if (key is None or owner == key) and since <= day <= until]

    # --- admin keys ----------------------------------------------------------------------------

    def key_records(self) -> dict[str, KeyRecord]:
        return dict(self.keys)

    def put_key(self, name: str, record: KeyRecord) -> None:
        self.keys[name] = record
        self.changed = True

    def delete_key(self, name: str) -> bool:
        self.changed = True
        return self.keys.pop(name, None) is not None

    # --- persistence ---------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """What must outlive the ledger's process: usage, budgets spent, admin keys."""
        oldest = period_of(self.clock() - USAGE_DAYS * 86400, "day")
        for stale in [k for k in self._usage if k[0] < oldest]:
            del self._usage[stale]
        self.changed = False
        return msgspec.json.encode({
            "usage": [[*key, *row] for key, row in self._usage.items()],
            "spent": self._spent, "names": self._names, "keys": self.keys})

    def restore(self, raw: bytes) -> None:
        state = msgspec.json.decode(raw)
        self._usage = {tuple(item[:4]): list(item[4:]) for item in state.get("usage", [])}
        self._spent = dict(state.get("spent", {}))
        self._names = dict(state.get("names", {}))
        self.keys = {name: msgspec.convert(record, KeyRecord)
                     for name, record in state.get("keys", {}).items()}

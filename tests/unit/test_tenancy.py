"""Tenancy with the fake engine (docs/tenancy.md): keys with policy held cluster-wide by one
ledger shared by several apps (as by ingress replicas), usage, tiers, the admin API."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from gateway.cluster.ledger import LEASE_S, Charge, Ledger, Limits
from gateway.cluster.ledger_actor import LocalLedger
from gateway.config import GatewayConfig, load_config
from gateway.ingress.asgi import create_app
from gateway.ingress.keys import ApiKey
from gateway.ingress.meter import FLUSH_S, KeyState, TenantMeter, priority_of
from gateway.ingress.registry import ModelRegistry
from tests.fake_engine import FakeEngine
from tests.recorded_metrics import Recorded

COMPLETION = {"model": "fake-model", "prompt": "Hi", "max_tokens": 5}  # 2 + 5 tokens
ADMIN = "root-secret"


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _apps(keys: list[ApiKey], ledger: LocalLedger, count: int = 2, engine=None,
          metrics: Recorded | None = None, **config):
    """``count`` gateway apps over one ledger: what ingress replicas are to the cluster's."""
    engine = engine or FakeEngine()
    cfg = GatewayConfig(api_keys=keys, admin_key=ADMIN, **config)
    metrics = metrics or Recorded()
    return [create_app(ModelRegistry({"fake-model": engine}), cfg, ledger=ledger,
                       metrics=metrics.metrics()) for _ in range(count)], engine


def _http(app, key: str | None = None) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                             headers=headers)


# --- the ledger alone ---------------------------------------------------------------------

def test_requests_per_minute_is_a_sliding_window():
    clock = Clock()
    ledger = Ledger(clock)
    limits = Limits(requests_per_min=3)
    assert [ledger.admit("k", limits, "a").admitted for _ in range(4)] == [True] * 3 + [False]
    refused = ledger.admit("k", limits, "b")
    assert refused.reason == "requests" and refused.retry_after_s == 60
    assert refused.requests.remaining == 0 and refused.requests.limit == 3
    clock.now += 59.5
    assert not ledger.admit("k", limits, "a").admitted
    clock.now += 0.6
    assert ledger.admit("k", limits, "a").admitted
    assert ledger.admit("other", limits, "a").admitted  # keys apart


def test_concurrency_slots_are_released_and_expire_with_their_holder():
    clock = Clock()
    ledger = Ledger(clock)
    limits = Limits(max_concurrent=2)
    first, second = ledger.admit("k", limits, "a"), ledger.admit("k", limits, "b")
    assert first.slot and second.slot and not ledger.admit("k", limits, "a").admitted
    ledger.release("k", first.slot)
    assert ledger.admit("k", limits, "a").admitted
    # Holder b dies with its slot: freed when its lease runs out, while a keeps renewing.
    clock.now += LEASE_S / 2
    ledger.renew("a")
    assert not ledger.admit("k", limits, "a").admitted
    clock.now += LEASE_S / 2 + 1
    assert ledger.admit("k", limits, "a").admitted


def test_tokens_per_minute_and_budgets_block_after_the_charge():
    clock = Clock()
    ledger = Ledger(clock)
    charge = Charge(key="k", name="n", model="m", protocol="openai", requests=1,
                    prompt_tokens=6, completion_tokens=5, tokens_per_min=10)
    assert ledger.charge([charge])["k"][0] >= 1
    refused = ledger.admit("k", Limits(tokens_per_min=10), "a")
    assert refused.reason == "tokens" and 59 <= refused.retry_after_s <= 60
    clock.now += 61
    assert ledger.admit("k", Limits(tokens_per_min=10), "a").admitted
    budget = Limits(token_budget=20)
    spend = Charge(key="k", name="n", model="m", protocol="openai", prompt_tokens=20,
                   token_budget=20)
    ledger.charge([spend])
    refused = ledger.admit("k", budget, "a")
    assert refused.reason == "budget" and "per day" in refused.message
    assert refused.retry_after_s <= 86400
    clock.now += 86400
    assert ledger.admit("k", budget, "a").admitted  # a new day, a new budget


def test_usage_budgets_and_admin_keys_survive_a_snapshot():
    clock = Clock()
    ledger = Ledger(clock)
    ledger.charge([Charge(key="id1", name="alice", model="m", protocol="openai", requests=2,
                          prompt_tokens=3, completion_tokens=4, token_budget=7)])
    restored = Ledger(clock)
    restored.restore(ledger.snapshot())
    [row] = restored.usage("id1")
    assert (row.key, row.requests, row.prompt_tokens, row.completion_tokens) == ("alice", 2, 3, 4)
    assert not restored.admit("id1", Limits(token_budget=7), "a").admitted


# --- cluster-wide through two apps ----------------------------------------------------------

async def test_a_request_rate_holds_across_replicas_and_keys_are_apart():
    keys = [ApiKey(key="limited", name="a", requests_per_min=4), ApiKey(key="free", name="b")]
    (one, two), _ = _apps(keys, LocalLedger())
    async with _http(one, "limited") as c1, _http(two, "limited") as c2, _http(two, "free") as f:
        answers = [await c.post("/v1/completions", json=COMPLETION) for c in (c1, c2) * 4]
        assert [a.status_code for a in answers] == [200] * 4 + [429] * 4
        refused = answers[-1]
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert refused.json()["error"]["type"] == "rate_limit_exceeded" or \
            refused.json()["error"]["code"] == 429
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        admitted = answers[0]
        assert admitted.headers["x-ratelimit-limit-requests"] == "4"
        assert admitted.headers["x-ratelimit-remaining-requests"] == "3"
        for _ in range(6):
            assert (await f.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_concurrent_requests_are_bounded_across_replicas():
    keys = [ApiKey(key="k", max_concurrent=2)]
    (one, two), _ = _apps(keys, LocalLedger(), engine=FakeEngine(delay=0.05))
    async with _http(one, "k") as c1, _http(two, "k") as c2:
        answers = await asyncio.gather(*(c.post("/v1/completions", json=COMPLETION)
                                         for c in (c1, c2, c1, c2)))
        assert sorted(a.status_code for a in answers) == [200, 200, 429, 429]
        assert (await c1.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_anthropic_answers_its_own_rate_limit_headers():
    import anthropic
    import httpx2

    keys = [ApiKey(key="k", requests_per_min=1, tokens_per_min=1000)]
    (app,), _ = _apps(keys, LocalLedger(), count=1)
    client = anthropic.AsyncAnthropic(base_url="http://gw", api_key="k", max_retries=0,
                                      http_client=httpx2.AsyncClient(
                                          transport=httpx2.ASGITransport(app=app),
                                          base_url="http://gw"))
    ask = [{"role": "user", "content": "Hi"}]
    raw = await client.messages.with_raw_response.create(model="fake-model", max_tokens=5,
                                                         messages=ask)
    assert raw.headers["anthropic-ratelimit-requests-limit"] == "1"
    assert raw.headers["anthropic-ratelimit-tokens-limit"] == "1000"
    assert raw.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    with pytest.raises(anthropic.RateLimitError) as limited:
        await client.messages.create(model="fake-model", max_tokens=5, messages=ask)
    assert limited.value.response.headers["retry-after"]
    assert limited.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"


async def test_allowed_models_and_tiers_shape_what_reaches_the_engine():
    keys = [ApiKey(key="gold", tier=0), ApiKey(key="other-only", models=["other"]),
            ApiKey(key="bronze", tier=3)]
    (app,), engine = _apps(keys, LocalLedger(), count=1)
    async with _http(app, "other-only") as c:
        r = await c.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 404 and "may not use it" in r.json()["error"]["message"]
    async with _http(app, "gold") as gold, _http(app, "bronze") as bronze:
        await gold.post("/v1/completions", json={**COMPLETION, "priority": 2})
        await bronze.post("/v1/completions", json=COMPLETION)
    gold_priority, bronze_priority = (r.priority for r in engine.requests[-2:])
    assert gold_priority == priority_of(0, 2, 0) and bronze_priority // 1000 == 3


def test_a_heavier_key_ranks_later_within_its_tier():
    meter = TenantMeter(LocalLedger())
    light, heavy = KeyState(owner="l", name="l"), KeyState(owner="h", name="h")

    async def spend():
        meter.count(light, "m", "openai", 5, 5, requests=1)
        meter.count(heavy, "m", "openai", 50_000, 50_000, requests=1)

    asyncio.run(spend())
    assert 0 < meter.rank(light) < meter.rank(heavy) <= 99
    assert meter.rank(KeyState(owner="new", name="new")) == 0


# --- usage ------------------------------------------------------------------------------------

async def test_usage_per_key_counts_exact_tokens_per_model_and_protocol():
    keys = [ApiKey(key="alice-key", name="alice"), ApiKey(key="bob-key", name="bob")]
    recorded = Recorded()
    (one, two), _ = _apps(keys, LocalLedger(), metrics=recorded)
    async with _http(one, "alice-key") as a1, _http(two, "alice-key") as a2, \
            _http(two, "bob-key") as b:
        for client in (a1, a2, a2):
            assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
        r = await a2.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}})
        assert r.status_code == 200
        await b.post("/v1/completions", json=COMPLETION)
        await asyncio.sleep(FLUSH_S * 2)  # the other replica's counts reach the ledger
        rows = (await a1.get("/gateway/usage")).json()["data"]
    by_protocol = {row["protocol"]: row for row in rows}
    assert {row["key"] for row in rows} == {"alice"}
    assert by_protocol["openai"]["requests"] == 3
    assert by_protocol["openai"]["prompt_tokens"] == 6
    assert by_protocol["openai"]["completion_tokens"] == 15
    assert by_protocol["tgi"]["completion_tokens"] == 3
    # The same in the metrics, by key name.
    assert recorded.count("llm_gateway_key_requests", key="alice") == 4
    assert recorded.count("llm_gateway_key_tokens", key="alice", kind="generated") == 18
    assert recorded.count("llm_gateway_key_requests", key="bob", protocol="openai") == 1


# --- the admin API ------------------------------------------------------------------------------

async def test_keys_made_by_the_admin_work_everywhere_and_stop_when_deleted(monkeypatch):
    from gateway.ingress import keys as key_module

    monkeypatch.setattr(key_module, "REFRESH_S", 0.0)
    ledger = LocalLedger()
    (one, two), _ = _apps([ApiKey(key="static", name="static")], ledger)
    async with _http(one, ADMIN) as admin, _http(two, "static") as user:
        assert (await user.get("/gateway/admin/keys")).status_code == 401
        made = await admin.post("/gateway/admin/keys",
                                json={"name": "carol", "requests_per_min": 1, "tier": 2})
        assert made.status_code == 201
        secret = made.json()["key"]
        assert secret.startswith("sk-gw-") and secret not in str(await ledger.keys())
        assert (await admin.post("/gateway/admin/keys", json={"name": "carol"})).status_code \
            == 409
        assert (await admin.post("/gateway/admin/keys",
                                 json={"name": "x", "tier": 9})).status_code == 400
        # The admin key is not an API key.
        assert (await admin.post("/v1/completions", json=COMPLETION)).status_code == 401
        sdk = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=secret, max_retries=0,
                                 http_client=_http(two))
        await sdk.completions.create(model="fake-model", prompt="Hi", max_tokens=5)
        with pytest.raises(openai.RateLimitError):
            await sdk.completions.create(model="fake-model", prompt="Hi", max_tokens=5)
        await asyncio.sleep(FLUSH_S * 2)
        usage = (await admin.get("/gateway/admin/usage", params={"key": "carol"})).json()
        assert usage["data"][0]["requests"] == 1
        assert (await admin.delete("/gateway/admin/keys/carol")).status_code == 200
        assert (await admin.delete("/gateway/admin/keys/carol")).status_code == 404
        with pytest.raises(openai.AuthenticationError):
            await sdk.completions.create(model="fake-model", prompt="Hi", max_tokens=5)


def test_policies_are_validated():
    for bad in ({"api_keys": [{"key": "a", "tier": 9}]},
                {"api_keys": [{"key": "a", "requests_per_min": 0}]},
                {"api_keys": [{"key": "a", "name": "n"}, {"key": "b", "name": "n"}]},
                {"api_keys": [{"key": "a"}], "admin_key": "a"},
                {"admin_key": " "}):
        with pytest.raises(ValueError):
            load_config(bad)


async def test_within_a_tier_a_light_key_overtakes_a_heavy_one_at_a_full_replica():
    """Fair share by tokens: both keys in tier 1, the replica's gate full; the heavy key's
    request waited first, the light key's starts first."""
    from engines.replica.priority_gate import PriorityGate

    engine = FakeEngine(delay=0.01)
    engine.gate = PriorityGate(max_running=1)
    keys = [ApiKey(key="heavy", name="heavy"), ApiKey(key="light", name="light")]
    (app,), _ = _apps(keys, LocalLedger(), count=1, engine=engine)
    finished: list[str] = []

    async def send(client: httpx.AsyncClient, name: str, max_tokens: int = 5) -> None:
        r = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": max_tokens})
        assert r.status_code == 200
        finished.append(name)

    async with _http(app, "heavy") as heavy, _http(app, "light") as light:
        for _ in range(4):  # the heavy key's recent tokens
            await send(heavy, "warm-up", 20)
        blocker = asyncio.create_task(send(heavy, "blocker", 20))  # holds the only slot
        await asyncio.sleep(0.05)
        waiting = asyncio.create_task(send(heavy, "heavy"))
        await asyncio.sleep(0.02)
        await asyncio.gather(blocker, waiting, send(light, "light"))
    assert finished[-3:] == ["blocker", "light", "heavy"]
    heavy_priority, light_priority = engine.requests[-2].priority, engine.requests[-1].priority
    assert heavy_priority // 1000 == light_priority // 1000 == 1
    assert light_priority < heavy_priority

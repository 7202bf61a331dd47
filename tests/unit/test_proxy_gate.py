"""The proxy's refusals before any Ray call (``gateway.edge.proxy.ProxyGate`` over
``gateway.edge.ingress_watch``): an application whose ingress has no replica, and a proxy at its
in-flight bound. The watch reads a stand-in for Serve; the real one is read in
``tests/e2e/test_reliability_e2e.py`` (the ingress replica killed)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest
from starlette.responses import JSONResponse

from gateway.edge.ingress_watch import IngressWatch, Reading, app_of, read_serve
from gateway.edge.proxy import ProxyErrorShape, ProxyGate

PREFIXES = (("/pipeline", "pipeline"), ("/", "gateway"))


class _Serve:
    """What the watch reads; ``down`` is the set of applications without an ingress."""

    def __init__(self):
        self.down: set[str] = set()
        self.reads = 0

    def read(self) -> Reading:
        self.reads += 1
        return Reading(PREFIXES, {app: int(app not in self.down) for _, app in PREFIXES})


def _app(delay_s: float = 0.0, release: asyncio.Event | None = None):
    async def app(scope, receive, send):
        if release is not None and scope["method"] == "POST":
            await release.wait()
        await asyncio.sleep(delay_s)
        await JSONResponse({"ok": True})(scope, receive, send)
    return app


def _client(inner, serve: _Serve, **options) -> httpx.AsyncClient:
    gate = ProxyGate(inner, watch=IngressWatch(serve.read, interval_s=0.01), **options)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=ProxyErrorShape(gate)),
                               base_url="http://proxy")
    client.gate = gate  # type: ignore[attr-defined]
    return client


async def _read_again(serve: _Serve) -> None:
    """Until the watch has read Serve after what the test just changed."""
    seen = serve.reads
    await _until(lambda: serve.reads >= seen + 2)


async def _until(condition, timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def test_paths_map_to_applications_by_the_longest_route_prefix():
    reading = Reading(PREFIXES)
    assert app_of(reading, "/pipeline/v1/completions") == "pipeline"
    assert app_of(reading, "/pipeline") == "pipeline"
    assert app_of(reading, "/pipelines/x") == "gateway"
    assert app_of(reading, "/generate") == "gateway"
    assert app_of(Reading((("/a", "a"),)), "/b") is None


async def test_an_application_without_an_ingress_is_refused_at_once_in_shape():
    serve = _Serve()
    async with _client(_app(), serve) as c:
        assert (await c.post("/v1/completions", json={})).status_code == 200
        serve.down = {"gateway"}
        await _read_again(serve)
        r = await c.post("/v1/completions", json={})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "restarting" in r.json()["error"]["message"]
        r = await c.post("/generate", json={})
        assert r.status_code == 503 and r.json()["error_type"]  # TGI's shape
        # another application under its own prefix is not affected
        assert (await c.post("/pipeline/v1/completions", json={})).status_code == 200
        serve.down = set()
        await _read_again(serve)
        assert (await c.post("/v1/completions", json={})).status_code == 200


async def test_a_request_held_for_a_dead_ingress_is_refused_when_the_watch_sees_it():
    """Serve holds a request for an application whose replica just died until a replacement
    starts; the gate answers it as soon as the watch reads the death."""
    serve, never = _Serve(), asyncio.Event()
    async with _client(_app(release=never), serve) as c:
        await c.get("/health")  # starts the watch
        held = asyncio.ensure_future(c.post("/v1/completions", json={}))
        await _until(lambda: c.gate.inflight == 1)
        await _read_again(serve)
        assert not held.done()
        serve.down = {"gateway"}
        r = await asyncio.wait_for(held, 10)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


async def test_beyond_the_bound_requests_are_refused_before_the_app_and_probes_pass():
    serve, release = _Serve(), asyncio.Event()
    async with _client(_app(release=release), serve, max_requests=2) as c:
        busy = [asyncio.ensure_future(c.post("/v1/completions", json={})) for _ in range(2)]
        await _until(lambda: c.gate.inflight == 2)
        await _read_again(serve)  # the routes known: /pipeline/health is a probe path
        r = await c.post("/invocations", json={})
        assert r.status_code == 503 and r.json()["code"] == 503 and "capacity" in r.text
        assert r.headers["retry-after"] == "1"
        assert (await c.get("/pipeline/health")).status_code == 200
        release.set()
        assert [b.status_code for b in await asyncio.gather(*busy)] == [200, 200]
        assert (await c.post("/v1/completions", json={})).status_code == 200


async def test_the_watch_reads_only_while_requests_come():
    serve = _Serve()
    watch = IngressWatch(serve.read, interval_s=0.01, idle_s=0.05)
    watch.is_down("/")
    await asyncio.wait_for(watch._task, 10)  # idle: it stops by itself, having read
    reads = serve.reads
    assert reads >= 1
    await asyncio.sleep(0.05)
    assert serve.reads == reads
    serve.down = {"gateway"}
    assert watch.is_down("/") is False  # a stale reading is dropped on restart
    await asyncio.wait_for(watch._task, 10)
    assert watch.reading.down == frozenset({"gateway"})  # what the restarted watch read


async def test_the_watch_reads_while_the_loops_thread_pool_is_full():
    """Other blocking calls may hold every thread of the loop's default executor (CI's earlier
    tests did): the watch reads on a thread of its own all the same."""
    import threading

    blocked, serve = threading.Event(), _Serve()
    loop = asyncio.get_running_loop()
    hogs = [loop.run_in_executor(None, blocked.wait) for _ in range(64)]
    try:
        watch = IngressWatch(serve.read, interval_s=0.01)
        watch.is_down("/")
        await _until(lambda: serve.reads >= 2)
        serve.down = {"gateway"}
        await _until(lambda: watch.is_down("/"))
    finally:
        blocked.set()
        await asyncio.gather(*hogs)


def _dead_then_silent(calls: list) -> Callable[[], Reading]:
    """Serve read once (the gateway's ingress gone), then every reading fails."""
    def read() -> Reading:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("controller busy")
        return Reading(PREFIXES, {"gateway": 0, "pipeline": 1})
    return read


@pytest.mark.parametrize("path", ["/v1/completions", "/lmtp"])
async def test_a_failing_reading_keeps_the_last_one(path):
    calls: list = []
    watch = IngressWatch(_dead_then_silent(calls), interval_s=0.01)
    watch.is_down(path)
    await _until(lambda: len(calls) > 2)
    assert watch.is_down(path) is True


async def test_probes_are_answered_from_the_last_answer_while_a_fresh_one_is_fetched():
    """Under a burst the ingress answered /health after 10 s; the proxy answers at once from
    its last answer (at most stale_s old) and fetches a new one in the background."""
    calls, answered, stuck = [], [], asyncio.Event()
    stuck.set()

    async def ingress(scope, receive, send):
        calls.append(scope["path"])
        await stuck.wait()  # cleared: the ingress does not answer (a burst)
        answered.append(scope["path"])
        await JSONResponse({"n": len(calls)})(scope, receive, send)

    gate = ProxyGate(ingress, watch=IngressWatch(_Serve().read, interval_s=0.01))
    gate.probes.refresh_s = 0.0  # every probe starts a refresh (one at a time)
    transport = httpx.ASGITransport(app=ProxyErrorShape(gate))
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        assert (await c.get("/health")).json() == {"n": 1}  # nothing cached: passed through
        stuck.clear()
        assert (await c.get("/health")).json() == {"n": 1}  # cached; a refresh is waiting
        assert (await c.get("/health")).json() == {"n": 1}  # cached; still one refresh
        await _until(lambda: len(calls) == 2)
        assert calls == ["/health", "/health"] and answered == ["/health"]
        stuck.set()
        await _until(lambda: len(answered) == 2)
        assert (await c.get("/health")).json() == {"n": 2}  # the refreshed answer
        r = await c.get("/pipeline/health")  # each path its own answer: fetched, not cached
        assert r.json()["n"] > 2 and calls[-1] == "/pipeline/health"
        r = await c.post("/health")  # GET only: anything else goes through
        assert r.status_code == 200 and r.json()["n"] == len(calls)


async def test_generations_beyond_what_the_ingress_can_admit_are_refused_at_the_proxy():
    """The ingress says on each answer how many generations it sends its models at most; the
    proxy refuses POSTs beyond that (plus a few) itself, and the client never sees the header."""
    from gateway.edge.proxy import _SLACK
    from gateway.ingress.limits import CAPACITY_HEADER, CapacityHeader

    release = asyncio.Event()
    serve = _Serve()
    ingress = CapacityHeader(_app(release=release), capacity=2)
    async with _client(ingress, serve) as c:
        await c.get("/v1/models")  # starts the watch
        await _read_again(serve)
        release.set()
        first = await c.post("/v1/completions", json={})  # learns the capacity
        assert first.status_code == 200 and CAPACITY_HEADER.decode() not in first.headers
        release.clear()
        busy = [asyncio.ensure_future(c.post("/v1/completions", json={}))
                for _ in range(2 + _SLACK)]
        await _until(lambda: c.gate.inflight == 2 + _SLACK)
        r = await c.post("/generate", json={})
        assert r.status_code == 503 and "capacity" in r.json()["error"]
        assert (await c.get("/v1/models")).status_code == 200  # GETs are not counted
        release.set()
        assert all(b.status_code == 200 for b in await asyncio.gather(*busy))
        assert (await c.post("/v1/completions", json={})).status_code == 200


async def test_with_no_news_from_serve_an_old_death_stops_being_refused():
    watch = IngressWatch(_dead_then_silent([]), interval_s=0.01, stale_s=0.1)
    assert watch.is_down("/v1/completions") is False  # nothing read yet
    await _until(lambda: watch.reading.down == frozenset({"gateway"}))
    await _until(lambda: not watch.reading.down)  # failed reads for stale_s: fail open


async def test_probe_answers_never_carry_the_capacity_and_only_probe_paths_are_cached():
    from gateway.ingress.limits import CAPACITY_HEADER, CapacityHeader

    serve = _Serve()
    async with _client(CapacityHeader(_app(), capacity=4), serve) as c:
        await c.get("/v1/models")
        await _read_again(serve)
        for path in ("/health", "/health", "/pipeline/health", "/junk/health", "/v1/health"):
            r = await c.get(path)
            assert CAPACITY_HEADER.decode() not in r.headers, path
        assert set(c.gate.probes._answers) == {"/health", "/pipeline/health"}
        assert c.gate.capacity == {"gateway": 4, "pipeline": 4}


def test_a_models_own_application_is_read_with_its_engine_replicas(monkeypatch):
    """A model's own application serves HTTP from its engine replicas (gateway.model_replica.ingress): the
    watch counts those, so a request for it is not taken for one of the gateway's at '/' (its
    replicas answered the gateway's outage with 503s before)."""
    import ray
    import ray.serve.context

    def replicas(prefix, deployment, alive):
        return {"route_prefix": prefix, "deployments": {deployment: {"replicas": [
            {"state": "RUNNING", "actor_name": f"{deployment}-r"}]} if alive else {}}}

    details = {"applications": {
        "gateway": {"route_prefix": "/", "deployments": {"GatewayIngress": {"replicas": []}}},
        "model-a": replicas("/model/a", "engine-a", alive=True),
        "engines": {"route_prefix": None, "deployments": {"engine-b": {"replicas": []}}}}}

    class Client:
        def get_serve_details(self):
            return details

    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda: Client())
    monkeypatch.setattr(ray.util, "list_named_actors",
                        lambda all_namespaces: [{"name": "engine-a-r"}])
    reading = read_serve()
    assert reading.replicas == {"gateway": 0, "model-a": 1}
    assert app_of(reading, "/model/a/v1/completions") == "model-a"
    assert reading.down == frozenset({"gateway"})


def test_a_replicas_own_http_server_gets_the_error_shaping_only(monkeypatch):
    """Serve calls the proxy callback in its proxy actor and in every replica's own HTTP server
    (direct ingress, behind HAProxy): the gate, whose watch polls Serve, only in the proxy."""
    import gateway.edge.proxy as proxy

    assert not proxy._in_replica()  # a test process is no Serve replica
    assert [m.cls for m in proxy.middlewares()] == [ProxyGate, ProxyErrorShape]
    monkeypatch.setattr(proxy, "_in_replica", lambda: True)
    assert [m.cls for m in proxy.middlewares()] == [ProxyErrorShape]


async def test_the_error_shaping_keeps_the_capacity_header_from_clients():
    """In a replica's own server (direct ingress) no gate takes the ingress's capacity header
    off: the error shaping does, on every answer."""
    from gateway.ingress.limits import CAPACITY_HEADER

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(CAPACITY_HEADER, b"32"), (b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    transport = httpx.ASGITransport(app=ProxyErrorShape(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.get("/v1/models")
    assert r.status_code == 200 and r.text == "ok"
    assert CAPACITY_HEADER.decode() not in r.headers

"""Which applications' gateway ingress can take a request now, as Serve's proxy sees it.

When the only ingress replica of an application dies, Serve's proxy keeps every new request in
its router until Serve has started a replacement (6-9 s on the 2-core box, measured with a
``kill -9``), and Ray Serve has no bound on that wait. The proxy middleware (``gateway.edge.proxy``)
asks this watch instead and refuses such requests at once with a 503 in the protocol's shape.

Two sources, read together every ``interval_s`` while requests arrive: Serve's controller (the
applications, their route prefixes and the ingress replicas it calls running) and Ray's GCS
(the named actors that exist: a killed replica's name is gone within about a second, while the
controller notices only at its next health check of it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import msgspec

from gateway.model_routes import engine_deployment, model_of_route

__all__ = ["INGRESS_DEPLOYMENT", "IngressWatch", "Reading", "read_serve"]

log = logging.getLogger("llm_gateway.proxy")

INGRESS_DEPLOYMENT = "GatewayIngress"  # gateway.app's ingress deployment, in every application


class Reading(msgspec.Struct, frozen=True):
    """Route prefixes (longest first) → application, and per application its ingress replicas
    that are both running (controller) and still there (GCS); none: the application is down."""

    prefixes: tuple[tuple[str, str], ...] = ()
    replicas: dict[str, int] = {}

    @property
    def down(self) -> frozenset[str]:
        return frozenset(app for app, count in self.replicas.items() if not count)


def _ingress_deployment(prefix: str | None) -> str:
    """The HTTP deployment of the application at ``prefix``: a model's own application serves
    HTTP from its engine replicas (gateway.model_replica.ingress), the gateway's from its ingress."""
    model = None if prefix is None else model_of_route(prefix)
    return INGRESS_DEPLOYMENT if model is None else engine_deployment(model)


def read_serve() -> Reading:
    """One reading of the controller and the GCS (blocking: call it off the event loop)."""
    import ray
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    live = {actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)}
    prefixes, replicas = [], {}
    for name, app in (details.get("applications") or {}).items():
        prefix = app.get("route_prefix")
        ingress = (app.get("deployments") or {}).get(_ingress_deployment(prefix))
        if ingress is None or prefix is None:  # not a gateway, or not served over HTTP
            continue
        prefixes.append((prefix, name))
        replicas[name] = sum(1 for r in ingress.get("replicas") or ()
                             if r.get("state") == "RUNNING" and r.get("actor_name") in live)
    prefixes.sort(key=lambda item: len(item[0]), reverse=True)
    return Reading(tuple(prefixes), replicas)


def route_of(reading: Reading, path: str) -> tuple[str, str] | None:
    """(route prefix, application) that ``path`` falls under (Serve's rule: the longest)."""
    for prefix, app in reading.prefixes:
        if prefix == "/" or path == prefix or path.startswith(prefix.rstrip("/") + "/"):
            return prefix, app
    return None


def app_of(reading: Reading, path: str) -> str | None:
    route = route_of(reading, path)
    return None if route is None else route[1]


class IngressWatch:
    """Re-reads Serve every ``interval_s`` while requests come (stops after ``idle_s`` without
    one: an idle proxy costs the controller nothing). Until the first reading, nothing is
    refused; a failed reading keeps the last one, for at most ``stale_s``."""

    def __init__(self, read: Callable[[], Reading] = read_serve, interval_s: float = 0.5,
                 idle_s: float = 30.0, stale_s: float = 5.0):
        self._read = read
        self.interval_s = interval_s
        self.idle_s = idle_s
        self.reading = Reading()
        self.stale_s = stale_s
        self._last_request = 0.0
        self._read_at = 0.0
        self._task: asyncio.Task | None = None
        self._reading: asyncio.Future | None = None
        self._went_down: asyncio.Future | None = None

    def route(self, path: str) -> tuple[str, str] | None:
        """(route prefix, gateway application) serving ``path``, as last read (and keeps the
        watch going)."""
        self._last_request = time.monotonic()
        if self._task is None or self._task.done():
            self.reading = Reading()  # after a quiet spell the last reading is stale
            self._task = asyncio.ensure_future(self._watch())
        return route_of(self.reading, path)

    def is_down(self, path: str) -> bool:
        """Whether the gateway application serving ``path`` has no ingress replica now."""
        route = self.route(path)
        return route is not None and route[1] in self.reading.down

    def went_down(self) -> asyncio.Future:
        """Resolved at the next reading that finds some application newly down (requests
        waiting for an ingress check :meth:`is_down` again then)."""
        if self._went_down is None or self._went_down.done():
            self._went_down = asyncio.get_running_loop().create_future()
        return self._went_down

    async def _watch(self) -> None:
        while True:  # read at least once per start, however late the task runs
            reading = await self._read_bounded()
            if reading is not None:
                self._apply(reading)
            elif time.monotonic() - self._read_at > self.stale_s and self.reading.down:
                # No news for a while (controller gone or stuck): refuse nothing rather than
                # keep refusing on an old death.
                log.warning("no reading of Serve for %.0f s: refusing nothing", self.stale_s)
                self.reading = Reading()
            if time.monotonic() - self._last_request >= self.idle_s:
                return
            await asyncio.sleep(self.interval_s)

    async def _read_bounded(self) -> Reading | None:
        """A reading, or None when it failed or takes longer than a few intervals (a stuck
        call stays the one in flight: no second thread is started beside it)."""
        if self._reading is None or self._reading.done():
            self._reading = _in_own_thread(self._read)
        try:
            return await asyncio.wait_for(asyncio.shield(self._reading), 4 * self.interval_s)
        except TimeoutError:
            return None
        except Exception as exc:  # controller busy or restarting: no news
            log.debug("reading Serve's applications failed: %r", exc)
            return None

    def _apply(self, reading: Reading) -> None:
        newly_down = reading.down - self.reading.down
        if reading.down != self.reading.down:
            log.warning("gateway applications without an ingress replica: %s",
                        sorted(reading.down) or "none")
        self.reading, self._read_at = reading, time.monotonic()
        if newly_down and self._went_down is not None and not self._went_down.done():
            self._went_down.set_result(None)


def _in_own_thread(read: Callable[[], Reading]) -> asyncio.Future:
    """``read()`` on a daemon thread of its own, not the loop's shared executor: that pool
    (6 threads on 2 cores) may be full of other blocking calls, and the watch must still read;
    a daemon thread stuck in a controller call does not hold the process at exit either."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    # a reading given up on (timed out) may still fail later: nobody is left to read that
    future.add_done_callback(lambda done: done.cancelled() or done.exception())

    def settle(result, exc) -> None:
        if not future.done():
            future.set_exception(exc) if exc is not None else future.set_result(result)

    def run() -> None:
        try:
            result, exc = read(), None
        except Exception as error:  # handed to the awaiting task, which logs it
            result, exc = None, error
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for this reading
            pass

    threading.Thread(target=run, name="ingress-watch-read", daemon=True).start()
    return future

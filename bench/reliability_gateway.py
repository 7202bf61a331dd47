"""The reliability bench's gateway under test (``bench/reliability.py``): a fresh local Ray
instance with Serve on a free loopback port, and the processes whose memory and CPU it reads."""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.reliability_clients import APP
from engines.kit.config import ModelConfig
from engines.kit.embedded import EMBEDDED_MODEL_NAME as MODEL
from gateway import serve_env
from gateway.config import GatewayConfig
from gateway.serve_env import free_port

ROOT = Path(__file__).resolve().parent.parent


def _bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Run a blocking call (Serve's deploy) in a daemon thread; give up after ``timeout_s``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=what, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Gateway:
    """A fresh local Ray instance (never someone else's) with Serve on a free loopback port."""

    def __init__(self) -> None:
        self.url = ""

    def start(self) -> None:
        import ray
        from ray import serve

        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        serve_env.apply()
        pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0",
                                           "PYTHONPATH": pythonpath}})
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.url = f"http://127.0.0.1:{port}"

    def deploy(self, engine_args: dict[str, Any] | None = None, timeout_s: float = 900) -> float:
        """(Re)deploy the app with these vLLM engine args; seconds until it answers /health."""
        from ray import serve

        from gateway.app import build_app

        config = GatewayConfig(models=[ModelConfig(name=MODEL, engine_args=engine_args or {})])
        started = time.monotonic()
        _bounded(lambda: serve.run(build_app(config), name=APP, route_prefix="/"), timeout_s,
                 "serve.run")
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"the gateway was not healthy within {timeout_s:.0f} s")

    def stop(self) -> None:
        import ray
        from ray import serve

        if ray.is_initialized():
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()


def _replica_processes(role: str, marker: str | None = None) -> list[psutil.Process]:
    """Top-level processes of this app's Serve replicas of ``role`` (Ray sets their title,
    e.g. ``ray::ServeReplica:relbench:GatewayIngress``), or of another ``marker``."""
    marker = marker or f"ServeReplica:{APP}:{role}"
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
    pids = {p.pid for p in found}
    return [p for p in found if p.ppid() not in pids]


def _mb(value: float) -> float:
    return round(value / 2**20, 1)


def ingress_rss_mb() -> float | None:
    total = 0
    procs = _replica_processes("GatewayIngress")
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return _mb(total) if procs else None


def engine_processes() -> list[psutil.Process]:
    """The engine replica and its children (vLLM's EngineCore)."""
    out = []
    for proc in _replica_processes(f"engine-{MODEL}"):
        out.append(proc)
        with contextlib.suppress(psutil.Error):
            out += proc.children(recursive=True)
    return out


def engine_rss() -> dict[str, Any]:
    rows = []
    for proc in engine_processes():
        with contextlib.suppress(psutil.Error):
            rows.append({"pid": proc.pid, "name": proc.name(), "rss_mb": _mb(proc.memory_info().rss)})
    return {"processes": rows, "total_mb": round(sum(r["rss_mb"] for r in rows), 1)}


def alive_pids(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))], 4)


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def serving_processes() -> dict[str, list[psutil.Process]]:
    return {"client": [psutil.Process()], "proxy": _replica_processes("", "ray::ProxyActor"),
            "ingress": _replica_processes("GatewayIngress"), "engine": engine_processes()}


def engine_replicas() -> list[tuple[str, str]]:
    import ray

    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#engine-")]

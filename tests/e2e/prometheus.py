"""A real Prometheus scraping the test session's Ray metrics agents, with the scrape
configuration the project ships (docs/grafana/prometheus.yml), for the observability tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.serve_env import free_port

SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "prometheus.yml"


def _agent_targets() -> list[str]:
    """Every live node's metrics agent, as the head's dashboard lists them in its discovery
    file (the session's Ray runs without a dashboard, so the file is written here)."""
    import ray

    return [f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
            for node in ray.nodes() if node["Alive"]]


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def query(self, expr: str) -> list[dict]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        assert response.status_code == 200, (expr, response.text)
        return response.json()["data"]["result"]

    def values(self, expr: str, *labels: str) -> dict[tuple[str, ...], float]:
        """The instant vector of ``expr`` keyed by the values of ``labels``."""
        return {tuple(item["metric"].get(label, "") for label in labels): float(item["value"][1])
                for item in self.query(expr)}

    def settled(self, exprs: dict[str, tuple[str, ...]], quiet_s: float = 8,
                timeout_s: float = 180) -> dict[str, dict]:
        """Each expression's values once none of them changed for ``quiet_s`` (Ray's agents
        export what processes recorded every few seconds, Prometheus scrapes every second)."""
        deadline = time.monotonic() + timeout_s
        last = {name: self.values(name, *labels) for name, labels in exprs.items()}
        since = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(1)
            now = {name: self.values(name, *labels) for name, labels in exprs.items()}
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return now
        pytest.fail(f"the series did not settle within {timeout_s:.0f} s: {last}")


@contextmanager
def running_prometheus(directory: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("no `prometheus` on PATH: scripts/install.sh installs Debian's package")
    discovery = directory / "ray_targets.json"
    discovery.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": _agent_targets()}]))
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    for job in config["scrape_configs"]:
        job["file_sd_configs"] = [{"files": [str(discovery)]}]
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(directory / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={directory / 'prometheus.yml'}",
             f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HOME": str(directory)})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, directory)
        yield Prometheus(url)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_ready(url: str, process: subprocess.Popen, directory: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, (directory / "prometheus.log").read_text()[-2000:]
        try:
            if httpx.get(f"{url}/-/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail("Prometheus did not become ready within 60 s")

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
from tests.serve_session import METRICS_REPORT_MS

SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "prometheus.yml"


def _agent_targets() -> list[str]:
    """Every live node's metrics agent, as the head's dashboard lists them in its discovery
    file (the session's Ray runs without a dashboard, so the file is written here)."""
    import ray

    return [f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
            for node in ray.nodes() if node["Alive"]]


# Prometheus caps a scrape's timeout at its interval. Ray's metrics agent takes 0.5 s to
# answer a scrape of the observability module's ~4,400 samples alone; at the end of the full
# suite it holds every earlier module's series and the box is busy: with a 1 s interval the
# counters read {} before and after the mix there (CI, an AVX2-only 2-core box), as if no
# scrape succeeded for minutes, while the module alone passed.
SCRAPE_S = 5
REPORT_S = METRICS_REPORT_MS / 1000  # how often Ray's processes hand their records to the agent


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

    def targets(self) -> list[dict]:
        """Each scrape target's health, last error and last scrape's duration, as Prometheus
        reports them (what a failure message needs to tell a slow agent from a missing one)."""
        response = httpx.get(f"{self.url}/api/v1/targets", timeout=30)
        return [{key: target.get(key) for key in ("scrapeUrl", "health", "lastError",
                                                    "lastScrape", "lastScrapeDuration")}
                for target in response.json()["data"]["activeTargets"]]

    def scraped_since(self, wall_time: float) -> bool:
        """Whether every agent has been scraped successfully by a scrape that began after
        ``wall_time`` (seconds since the epoch)."""
        up = self.values('up{job="ray"}', "instance")
        began = self.values('timestamp(up{job="ray"})', "instance")
        return bool(up) and all(up[key] == 1 and began[key] > wall_time for key in up)

    def wait_scraped(self, timeout_s: float = 120) -> None:
        """Until every agent the discovery file names has been scraped successfully once."""
        deadline = time.monotonic() + timeout_s
        while not self.scraped_since(0):
            if time.monotonic() > deadline:
                pytest.fail(f"Ray's metrics agents were not scraped within {timeout_s:.0f} s: "
                            f"{self.targets()}")
            time.sleep(1)

    def settled(self, exprs: dict[str, tuple[str, ...]], timeout_s: float = 240
                ) -> dict[str, dict]:
        """Each expression's values once a successful scrape found them unchanged that began a
        report interval and a scrape interval after they last changed (by then what the
        processes had recorded has reached the agents and been read)."""
        deadline = time.monotonic() + timeout_s
        last = {name: self.values(name, *labels) for name, labels in exprs.items()}
        changed = time.time()
        while time.monotonic() < deadline:
            time.sleep(1)
            fresh = self.scraped_since(changed + REPORT_S + SCRAPE_S)  # before reading values
            now = {name: self.values(name, *labels) for name, labels in exprs.items()}
            if now != last:
                last, changed = now, time.time()
            elif fresh:
                return now
        pytest.fail(f"the series did not settle within {timeout_s:.0f} s: {last}; "
                    f"targets: {self.targets()}")


@contextmanager
def running_prometheus(directory: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("no `prometheus` on PATH: scripts/install.sh installs Debian's package")
    discovery = directory / "ray_targets.json"
    discovery.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": _agent_targets()}]))
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    config["global"].update(scrape_interval=f"{SCRAPE_S}s", scrape_timeout=f"{SCRAPE_S}s",
                            evaluation_interval=f"{SCRAPE_S}s")
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
        server = Prometheus(url)
        server.wait_scraped()
        yield server
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

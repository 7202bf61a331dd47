"""Serve's status, read once per monitor tick for every model's engine client in a process
(``gateway.ingress.engine_client``: the monitor that notices a dead replica while no stream runs)."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray import serve

__all__ = ["SERVE_STATUS", "ServeStatus"]


class ServeStatus:
    """``serve.status()`` once per monitor tick for every model's client in this process.

    Each call asks the controller for every application's status, so one call per model per
    tick would cost the controller (models x ingress replicas) calls of (applications) each.
    Monitors tick on the same instants (multiples of their interval on the monotonic clock) and
    share a reading younger than half an interval. Blocking: called on the monitors' threads.
    """

    def __init__(self) -> None:
        # The monitors' own thread: their question must not wait behind whatever else fills
        # the loop's default executor (in the full test session, after the e2e suites, a
        # monitor's second question never ran there). Started at the first question.
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="engine-monitor")
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._status: Any = None

    def read(self, fresh_s: float) -> Any:
        with self._lock:  # a second monitor waits for the reading under way and shares it
            if time.monotonic() - self._read_at >= fresh_s:
                self._status = serve.status()
                self._read_at = time.monotonic()
            return self._status

    def running_replicas(self, app: str, deployment: str, fresh_s: float) -> int:
        """How many of ``deployment``'s replicas Serve reported running in a reading at most
        ``fresh_s`` old."""
        if not ray.is_initialized():  # serve.status() would start a local Ray instance
            raise RuntimeError("Ray is not initialized here")
        status = self.read(fresh_s).applications[app].deployments[deployment]
        return status.replica_states.get("RUNNING", 0)  # a str enum


SERVE_STATUS = ServeStatus()  # the process's one

"""A client leaves a stream mid-way; the engine must count the abort (``/gateway/engines``).
Shared by the protocol e2e tests and the Serve-proxy layout's program."""

from __future__ import annotations

import time

import httpx

__all__ = ["drop_stream", "engine_stats", "wait_for_abort"]


def engine_stats(http: httpx.Client, model: str) -> dict:
    """The gateway's counters for ``model``'s engine (active, aborted, ...)."""
    return http.get("/gateway/engines").json()[model]


def drop_stream(http: httpx.Client, path: str, body: dict, lines: int = 3,
                prefix: str = "") -> None:
    """POST a streaming ``body`` and leave after ``lines`` non-empty lines starting with
    ``prefix``: leaving the block closes the connection mid-stream."""
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        seen = 0
        for line in response.iter_lines():
            seen += bool(line.strip()) and line.startswith(prefix)
            if seen >= lines:
                return


def wait_for_abort(http: httpx.Client, model: str, before: int, timeout_s: float = 30) -> dict:
    """``model``'s engine counters once it counted an abort beyond ``before`` and runs nothing
    (or as they are after ``timeout_s``: the caller asserts what it expects)."""
    deadline = time.monotonic() + timeout_s
    stats = engine_stats(http, model)
    while time.monotonic() < deadline and (stats["active"] or stats["aborted"] <= before):
        time.sleep(0.2)
        stats = engine_stats(http, model)
    return stats

"""Session fixtures for every test directory; items that need the real engine are marked e2e."""

import os

import pytest

from gateway import serve_env

# The tests build their Serve applications in this process (serve.run), and Serve's builder reads
# whether HAProxy is on when Serve is first imported: a model routed by prefix gets its ingress
# request router only under HAProxy (docs/routing.md), as the session's Ray runs. Only that
# setting: the rest of the serve environment would change how this process's handles run.
os.environ.setdefault("RAY_SERVE_ENABLE_HA_PROXY", serve_env.HAPROXY_ENV["RAY_SERVE_ENABLE_HA_PROXY"])

from tests.serve_session import (
    colocated_url,
    engine_handle,
    gateway_url,
    logprob_tolerance,
    pipeline_handle,
    pipeline_url,
)

__all__ = ["colocated_url", "engine_handle", "gateway_url", "logprob_tolerance", "pipeline_handle",
           "pipeline_url"]


def pytest_collection_modifyitems(items):
    for item in items:
        if "/e2e/" in str(item.fspath) or "gateway_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)

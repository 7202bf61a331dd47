"""Session fixtures for every test directory; items that need the real engine are marked e2e."""

import pytest

from gateway import serve_env

# The environment Ray starts with for the gateway (HAProxy on, ...), applied before anything
# imports Ray Serve: the tests build their Serve applications in this process (serve.run), and
# Serve's builder reads that environment when it is first imported (an ingress request router,
# docs/routing.md, needs HAProxy on in the builder too).
serve_env.apply()

from tests.serve_session import (  # noqa: E402
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

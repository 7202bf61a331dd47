"""Session fixtures for every test directory; items that need the real engine are marked e2e."""

import pytest

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

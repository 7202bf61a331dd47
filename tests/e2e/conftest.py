"""Clients for the end-to-end tests (the session gateway itself is ``tests.serve_session``)."""

from __future__ import annotations

import httpx
import pytest

from tests.serve_session import APP_NAME, MAX_REQUEST_BYTES, MODEL, _free_port

__all__ = ["APP_NAME", "MAX_REQUEST_BYTES", "MODEL", "_free_port"]


@pytest.fixture(scope="session")
def openai_client(gateway_url):
    from openai import OpenAI

    return OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def async_openai_client(gateway_url):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def http(gateway_url):
    with httpx.Client(base_url=gateway_url, timeout=120) as client:
        yield client

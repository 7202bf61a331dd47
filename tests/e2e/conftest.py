"""Clients for the end-to-end tests (the session gateway itself is ``tests.serve_session``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import httpx
import pytest

from tests.serve_session import APP_NAME, MAX_REQUEST_BYTES, MODEL

__all__ = ["APP_NAME", "MAX_REQUEST_BYTES", "MODEL", "assert_greedy_or_near_tie"]


def assert_greedy_or_near_tie(tokens: Sequence, tops: Sequence[Mapping], reference: Sequence,
                              tolerance: float) -> None:
    """A concurrent stream's greedy ``tokens`` are ``reference`` (vLLM's greedy run alone), or
    leave it only at a near-tie: concurrent requests share a batch and bf16 CPU kernels are not
    batch-invariant (measured on an AVX512-BF16 box: the same prompt gave two continuations
    whose first tokens tie). A mixed-up stream would instead diverge where its own distribution
    (``tops[k]``, keyed like the tokens) gives the reference token no chance."""
    k = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), None)
    if k is None:
        assert list(tokens) == list(reference)  # same prefix: one may not simply stop early
        return
    top = tops[k]
    assert reference[k] in top, (k, tokens, reference, top)
    assert top[tokens[k]] - top[reference[k]] <= tolerance, (k, tokens, reference, top)


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

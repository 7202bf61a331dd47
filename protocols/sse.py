"""Server-sent events: the one framing every streaming protocol writes, each with its prefix
and terminator: ``data: `` for OpenAI, AICI and LMI (``[DONE]`` after OpenAI's and AICI's),
``data:`` for MindIE and TGI, ``event:`` lines for Anthropic and the Responses API.

JSON is encoded with msgspec: compact separators, UTF-8 as is (no ``\\u`` escapes), NaN and
infinities as ``null`` (never as bare tokens, which JSON cannot carry), and a fraction of
``json.dumps``' time per chunk, which runs once per streamed token in the replica
that serves the request (docs/results/benchmarks-2026-12-07.md, "The replica's own cost per token, on an AVX2
box").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

__all__ = ["DONE", "data_events", "json_bytes", "named_events"]

# OpenAI's (and AICI's) last event.
DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()
json_bytes = _encoder.encode


async def data_events(objects: AsyncIterator[Any], *, prefix: bytes = b"data: ",
                      done: bytes | None = None) -> AsyncIterator[bytes]:
    """``<prefix><json>`` and a blank line per object, then ``done`` (if any)."""
    async for obj in objects:
        yield prefix + json_bytes(obj) + b"\n\n"
    if done is not None:
        yield done


async def named_events(items: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[bytes]:
    """``event: <name>`` then ``data: <json>`` per item (Anthropic's and the Responses API's)."""
    async for name, data in items:
        yield b"event: " + name.encode() + b"\ndata: " + json_bytes(data) + b"\n\n"

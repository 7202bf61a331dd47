"""Internal events → LMTP TOKEN items. Pure async-generator transforms, one stream each.

A stream ends at its first item with a non-null ``finish_reason`` or at its error item; every
generated token is sent exactly once (the reference server repeats the last one; we don't).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

from contract import (
    BacktrackEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    ForkEvent,
    PromptEvent,
    TokenEvent,
    as_error,
)

__all__ = ["generate_items", "score_items"]

# LMQL treats scores at or below -3e38 as masked; a non-finite value is not valid JSON.
_FLOOR = -3.0e38


def _finite(value: float | None) -> float:
    if value is None:
        return 0.0
    return value if math.isfinite(value) else _FLOOR


def _error(stream_id: Any, message: str) -> dict[str, Any]:
    return {"stream_id": stream_id, "error": message}


def _token_item(stream_id: Any, event: TokenEvent) -> dict[str, Any]:
    logprob = _finite(event.logprob)
    top = {str(event.token_id): logprob}  # the chosen token first, then the top-k
    for alt in event.top_logprobs:
        if math.isfinite(alt.logprob):
            top.setdefault(str(alt.token_id), alt.logprob)
    return {"token": event.token_id, "stream_id": stream_id, "logprob": logprob,
            "finish_reason": None, "top_logprobs": top}


async def generate_items(events: AsyncIterator[Event], stream_id: Any) -> AsyncIterator[dict]:
    """GENERATE: one item per token; the last carries ``stop`` (EOS) or ``length``.

    Tokens go out as they arrive; only a token flagged ``last`` waits for its FinalEvent (which
    the engine emits right behind it) so that it can carry the finish reason.
    """
    pending: dict[str, Any] | None = None
    async for event in events:
        if isinstance(event, (ErrorEvent, BacktrackEvent, ForkEvent)):
            if pending is not None:  # LMTP streams only grow: a splice ends one like an error
                yield pending
            yield _error(stream_id, as_error(event).message)
            return
        if isinstance(event, TokenEvent):
            if pending is not None:  # a 'last' token that was not the last after all
                yield pending
                pending = None
            item = _token_item(stream_id, event)
            if event.last:
                pending = item
            else:
                yield item
        elif isinstance(event, FinalEvent):
            if event.finish_reason in ("abort", "error") or pending is None:
                if pending is not None:
                    yield pending
                yield _error(stream_id, f"generation ended early ({event.finish_reason})")
                return
            pending["finish_reason"] = "length" if event.finish_reason == "length" else "stop"
            yield pending
            return
    if pending is not None:  # engine stream ended without a final event: never leave it open
        yield pending
    yield _error(stream_id, "generation ended without a finish reason")


async def score_items(events: AsyncIterator[Event], stream_id: Any, start: int,
                      count: int) -> AsyncIterator[dict]:
    """SCORE: ``count`` items for prompt positions ``start..start+count-1``, last one ``stop``.

    ``logprob`` is log P(token | everything before it) under the raw model; a position with no
    context (empty prompt) reports 0.0, as the reference does.
    """
    async for event in events:
        if isinstance(event, ErrorEvent):
            yield _error(stream_id, event.message)
            return
        if isinstance(event, PromptEvent):
            scored = event.tokens[start:start + count]
            for j, token in enumerate(scored):
                yield {"token": token.token_id, "stream_id": stream_id,
                       "logprob": _finite(token.logprob),
                       "finish_reason": "stop" if j == len(scored) - 1 else None}
            # Let the request finish on its own (one decode step) rather than abort it.
            async for _ in events:
                pass
            return
    yield _error(stream_id, "the engine returned no prompt scores")

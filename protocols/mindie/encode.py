"""Internal events → MindIE responses. ``stream_events`` is a pure async-generator transform.

Per event (``details`` on): running ``generated_tokens``, the engine's batch size when the token
was produced, ``queue_wait_time`` in µs (the request's queue wait on the first event, 0 after),
``prefill_time`` (ms, first event) and ``decode_time`` (ms since the previous event's token),
all measured in the engine. ``finish_reason`` only on the last event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from contract import (
    BacktrackEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    ForkEvent,
    TokenEvent,
    as_error,
)
from protocols.mindie.errors import from_event
from protocols.sse import data_events
from protocols.streams import fold_splices

__all__ = ["ResponseMeta", "collect_response", "finish_reason", "sse", "stream_events"]

_FINISH = {"eos": "eos_token", "length": "length", "stop_sequence": "stop_sequence",
           # the seed's stop_sequence also covers a request that was cancelled or failed
           "abort": "stop_sequence", "error": "stop_sequence"}


def finish_reason(event: FinalEvent) -> str:
    return _FINISH[event.finish_reason]


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    model: str
    details: bool
    full_text: bool = False  # MindIE's fullTextEnabled: cumulative text_output per event


class _Step:
    """Accumulates tokens until there is text to send (incomplete characters merge forward)."""

    def __init__(self) -> None:
        self.text = ""
        self.token: TokenEvent | None = None


async def stream_events(events: AsyncIterator[Event], meta: ResponseMeta) -> AsyncIterator[dict]:
    generated = 0
    sent_text = ""
    previous_elapsed: float | None = None
    queue_us: int | None = None
    step = _Step()

    def event(final: FinalEvent | None) -> dict[str, Any]:
        nonlocal sent_text, previous_elapsed, queue_us
        sent_text += step.text
        out: dict[str, Any] = {"id": meta.id, "model_name": meta.model, "model_version": None,
                               "text_output": sent_text if meta.full_text else step.text}
        if meta.details:
            token = step.token
            elapsed = token.elapsed_s if token else previous_elapsed or 0.0
            details: dict[str, Any] = {}
            if final is not None:
                details["finish_reason"] = finish_reason(final)
            details.update(generated_tokens=generated, first_token_cost=None, decode_cost=None,
                           batch_size=token.batch_size if token else 0,
                           queue_wait_time=queue_us or 0)
            out["details"] = details
            first = previous_elapsed is None
            out["prefill_time"] = round(elapsed * 1000, 3) if first else None
            out["decode_time"] = None if first else round((elapsed - previous_elapsed) * 1000, 3)
            previous_elapsed = elapsed
            queue_us = 0  # only the first event waited in the queue
        step.text, step.token = "", None
        return out

    async for item in events:
        if isinstance(item, (ErrorEvent, BacktrackEvent, ForkEvent)):
            exc = from_event(as_error(item))  # a stream only grows: a splice ends it
            yield {"error": exc.message, "error_type": "Generation Error"}
            return
        if isinstance(item, TokenEvent):
            generated += 1
            if item.queue_s is not None and queue_us is None:
                queue_us = round(item.queue_s * 1e6)
            step.text += item.text
            step.token = item
            if step.text and not item.last:
                yield event(None)
        elif isinstance(item, FinalEvent):
            step.text += item.text
            yield event(item)
            return


def sse(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """MindIE framing: ``data:`` with no space, a blank line after each event, no [DONE]."""
    return data_events(events, prefix=b"data:")


async def collect_response(events: AsyncIterator[Event], meta: ResponseMeta) -> dict:
    """The non-streaming body (backtracks applied; MindIE has one sequence, so only choice 0
    is reported); an error raises :class:`~protocols.errors.EnvelopeError`."""
    text: list[str] = []
    batch_sizes: list[int] = []
    queue_wait: list[int] = []
    final: FinalEvent | None = None
    async for item in fold_splices(events):
        if isinstance(item, ErrorEvent):
            raise from_event(item)
        if getattr(item, "index", 0) != 0:
            continue
        if isinstance(item, TokenEvent):
            text.append(item.text)
            batch_sizes.append(item.batch_size)
            queue_wait.append(round(item.queue_s * 1e6) if item.queue_s is not None else 0)
        elif isinstance(item, FinalEvent):
            text.append(item.text)
            final = item
    body: dict[str, Any] = {"id": meta.id, "model_name": meta.model, "model_version": None,
                            "text_output": "".join(text)}
    if meta.details:
        body["details"] = {
            "finish_reason": finish_reason(final) if final else "stop_sequence",
            "generated_tokens": len(batch_sizes), "first_token_cost": None, "decode_cost": None,
            "batch_size": batch_sizes, "queue_wait_time": queue_wait,
        }
    return body

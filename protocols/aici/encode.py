"""Internal events → AICI's ``/v1/run`` server-sent events (``docs/protocols/aici.md``, "REST API").

``run_objects`` is a pure transform (events in, JSON objects out); ``sse`` frames them. The
shape is AICI's: ``initial-run`` first, then one ``run`` object per engine event with a
``forks`` entry per choice it concerns (``text`` is a delta; a backtrack adds ``" ↩ "`` and
retracts nothing; ``logs``, ``storage`` and ``micros`` are what the controller produced since
the choice's previous event, as the engine learns of them), cumulative ``usage`` on every
``run`` (pyaici reads ``ff_tokens`` from the first one), and ``data: [DONE]`` last. A new
fork's first entry carries its parent's text as it stands (withdrawn text cut), as AICI's
forked sequence decodes every token it inherited (its ``fork_1`` test expects each fork's text
to start with the common prefix). An ``ErrorEvent`` whose ``param`` is ``"deadlock"`` (every
fork suspended) ends the running forks with AICI's ``deadlock``, any other with ``fail``.
pyaici.rest refuses any other line, so no comments or keep-alives are sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from contract import (
    DEADLOCK,
    BacktrackEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    ForkEvent,
    TokenEvent,
)
from protocols.sse import DONE, data_events

__all__ = ["BACKTRACK_MARK", "RunMeta", "finish_reason", "run_objects", "sse"]

BACKTRACK_MARK = " ↩ "


class RunMeta(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    model: str
    created: int
    prompt_tokens: int  # ff_tokens counts the prompt, as AICI's server does
    controlled: bool  # an engine-side controller decides the end ("aici-stop")


def finish_reason(final: FinalEvent, controlled: bool) -> str:
    """AICI's names. With a controller, EOS is only an end when the controller said so."""
    if final.finish_reason in ("eos", "stop_sequence"):
        return "aici-stop" if controlled else "eos"
    return {"length": "length", "abort": "abort"}.get(final.finish_reason, "fail")


def _fork(index: int, text: str = "", error: str = "", finish: str | None = None,
          logs: str = "", storage: tuple | list = (), micros: int = 0) -> dict:
    entry: dict[str, Any] = {"index": index}
    if finish is not None:
        entry["finish_reason"] = finish
    entry.update(text=text, error=error, logs=logs, storage=list(storage), micros=micros)
    return entry


async def run_objects(events: AsyncIterator[Event], meta: RunMeta) -> AsyncIterator[dict]:
    yield {"id": meta.id, "object": "initial-run", "created": meta.created, "model": meta.model}
    sampled = forced = 0
    running = {0}
    current: dict[int, str] = {}  # each fork's text as it stands (for the forks it starts)

    def run(*forks: dict) -> dict:
        ff = meta.prompt_tokens + forced
        return {"object": "run", "forks": list(forks),
                "usage": {"sampled_tokens": sampled, "ff_tokens": ff, "cost": 2 * sampled + ff}}

    async for event in events:
        if isinstance(event, TokenEvent):
            if event.forced:
                forced += 1
            else:
                sampled += 1
            current[event.index] = current.get(event.index, "") + event.text
            yield run(_fork(event.index, event.text, logs=event.logs, storage=event.storage,
                            micros=event.micros))
        elif isinstance(event, BacktrackEvent):
            text = current.get(event.index, "")
            if event.text and text.endswith(event.text):
                current[event.index] = text[:-len(event.text)]
            yield run(_fork(event.index, BACKTRACK_MARK))
        elif isinstance(event, ForkEvent):
            running.add(event.index)
            current[event.index] = current.get(event.parent, "")
            if current[event.index]:
                yield run(_fork(event.index, current[event.index]))
        elif isinstance(event, FinalEvent):
            running.discard(event.index)
            # What the controller logged, stored and spent since its last token's event.
            yield run(_fork(event.index, event.text, finish=finish_reason(event, meta.controlled),
                            logs=event.logs, storage=event.storage, micros=event.micros))
        elif isinstance(event, ErrorEvent):
            finish = DEADLOCK if event.param == DEADLOCK else "fail"
            yield run(*(_fork(i, error=event.message, finish=finish)
                        for i in sorted(running or {0})))
            return


def sse(objects: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    return data_events(objects, done=DONE)

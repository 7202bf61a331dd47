"""Internal events → LMI and TGI response objects, and their stream framings.

Two writers share one set of transforms: :class:`LMIWriter` (the seed's rolling-batch shapes:
``log_prob``, ``special_token`` only when true, ``details.inputs``) and :class:`TGIWriter` (TGI's
``GenerateResponse`` / ``StreamResponse``: ``logprob``, ``special`` always, ``seed``, ``prefill``,
``index``; with ``inputs`` added in LMI's TGI-compatible mode). ``stream_objects`` and
``dynamic_lines`` are pure async-generator transforms; ``jsonlines`` and ``sse`` frame them.
The writers and the per-sequence records are ``protocols/textgen/writers.py``.

A token's ``text`` is the text it completes (incremental detokenization, as TGI does): without
stop strings the texts of the non-special tokens concatenate to ``generated_text``; with them,
the tokens that matched a stop string keep their text though ``generated_text`` drops it. A
special token that adds no text reports its own piece (``<|im_end|>``) instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

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
from protocols.sse import data_events, json_bytes
from protocols.streams import fold_splices
from protocols.textgen.writers import (
    LMIWriter,
    ResponseMeta,
    SequenceResult,
    TGIWriter,
    finish_reason,
    token_text,
)

__all__ = ["GenerationFailed", "LMIWriter", "ResponseMeta", "SequenceResult", "TGIWriter",
           "best_sequence", "collect", "dynamic_lines", "finish_reason", "gather_or_cancel",
           "jsonlines", "response_body", "sse", "stream_objects"]

T = TypeVar("T")


class GenerationFailed(Exception):
    """The engine refused or failed the request; ``event`` says how (routes pick the status)."""

    def __init__(self, event: ErrorEvent):
        super().__init__(event.message)
        self.event = event


def _failed(final: FinalEvent) -> ErrorEvent:
    why = "timed out" if final.stop_reason == "timeout" else "was aborted"
    return ErrorEvent(kind="engine", message=f"generation {why} before it finished")


async def stream_objects(events: AsyncIterator[Event], meta: ResponseMeta,
                         writer: LMIWriter) -> AsyncIterator[dict[str, Any]]:
    """One object per generated token; the last also carries ``generated_text`` (and ``details``
    when asked). The token before a :class:`FinalEvent` is held until the final arrives, so
    text the detokenizer flushes at the end still lands in that token."""
    prompt: PromptEvent | None = None
    parts: list[str] = [meta.prefix]
    position = 0
    held: TokenEvent | None = None
    sent: TokenEvent | None = None

    def step(event: TokenEvent, text: str) -> dict[str, Any]:
        top = writer.top_tokens(event, meta) if meta.top_n_tokens else None
        return writer.step(position, writer.token(event, text), top)

    async for event in events:
        if isinstance(event, PromptEvent):
            prompt = event
        elif isinstance(event, (ErrorEvent, BacktrackEvent, ForkEvent)):
            yield writer.stream_error(as_error(event).message)  # a stream only grows
            return
        elif isinstance(event, TokenEvent):
            parts.append(event.text)
            if event.last:
                held = event
                continue
            yield step(event, token_text(event))
            sent = event
            position += 1
        elif isinstance(event, FinalEvent):
            if event.finish_reason in ("abort", "error"):
                yield writer.stream_error(_failed(event).message)
                return
            parts.append(event.text)
            last = held or sent
            if last is None:  # the engine contract guarantees a token first; be safe anyway
                yield writer.stream_error("the engine finished without generating a token")
                return
            # Without a held token (not expected from the engines) the flushed text rides on a
            # repeat of the last token's id with no text of its own.
            text = token_text(held, event.text) if held else event.text
            details = writer.stream_details(event, meta, prompt) if meta.details else None
            yield writer.last(step(last, text), "".join(parts), details)
            return
    # The engine stream ended without a final event (a replica died mid-request).
    yield writer.stream_error("incomplete generation", "incomplete_generation")


async def collect(events: AsyncIterator[Event]) -> tuple[PromptEvent | None, list[SequenceResult]]:
    """Gather a non-streamed request (backtracks applied, forks as extra sequences). Raises
    :class:`GenerationFailed` on any failure."""
    prompt: PromptEvent | None = None
    sequences: dict[int, SequenceResult] = {}
    async for event in fold_splices(events):
        if isinstance(event, PromptEvent):
            prompt = event
        elif isinstance(event, ErrorEvent):
            raise GenerationFailed(event)
        elif isinstance(event, TokenEvent):
            seq = sequences.setdefault(event.index, SequenceResult(event.index))
            seq.tokens.append(event)
            seq.text += event.text
        elif isinstance(event, FinalEvent):
            if event.finish_reason in ("abort", "error"):
                raise GenerationFailed(_failed(event))
            seq = sequences.setdefault(event.index, SequenceResult(event.index))
            seq.text += event.text
            seq.final = event
    done = [s for _, s in sorted(sequences.items()) if s.final is not None]
    if not done:
        raise GenerationFailed(ErrorEvent(kind="engine", message="the engine returned no output"))
    return prompt, done


def best_sequence(sequences: Sequence[SequenceResult]) -> SequenceResult:
    """The most likely sequence (highest cumulative logprob; ties: the first)."""
    return max(sequences, key=lambda s: (s.cumulative_logprob, -s.index))


def response_body(prompt: PromptEvent | None, sequences: Sequence[SequenceResult],
                  meta: ResponseMeta, writer: LMIWriter) -> dict[str, Any]:
    """``{"generated_text", "details"?}``: the most likely sequence on top (ties: the first),
    the others in ``details.best_of_sequences``."""
    best = best_sequence(sequences)
    body: dict[str, Any] = {"generated_text": meta.prefix + best.text}
    if meta.details:
        details = writer.details(best, meta, prompt)
        if len(sequences) > 1:
            details["best_of_sequences"] = [writer.best_of(s, meta, prompt)
                                            for s in sequences if s is not best]
        body["details"] = details
    return body


async def _texts(events: AsyncIterator[Event]) -> AsyncIterator[str]:
    """Per generated token, the text it adds (special tokens add none)."""
    held: TokenEvent | None = None
    async for event in events:
        if isinstance(event, (ErrorEvent, BacktrackEvent, ForkEvent)):  # a stream only grows
            raise GenerationFailed(as_error(event))
        if isinstance(event, TokenEvent):
            if held is not None:
                yield _plain(held)
            held = event
        elif isinstance(event, FinalEvent):
            if event.finish_reason in ("abort", "error"):
                raise GenerationFailed(_failed(event))
            if held is not None:
                yield _plain(held, event.text)
            return
    raise GenerationFailed(ErrorEvent(kind="engine", message="incomplete generation"))


def _plain(event: TokenEvent, extra: str = "") -> str:
    return event.text + extra if event.piece is None else event.piece


async def gather_or_cancel(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Results in order; the first failure cancels the others (aborting their engine
    requests) before it is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def dynamic_lines(streams: Sequence[AsyncIterator[Event]]) -> AsyncIterator[dict[str, Any]]:
    """Dynamic-batch streaming: per step ``{"outputs": [text per input]}``, in input order
    (``""`` for inputs that already finished). Raises :class:`GenerationFailed`."""
    texts = [_texts(s) for s in streams]
    open_ = [True] * len(texts)

    async def next_text(i: int) -> str | None:
        if not open_[i]:
            return None
        try:
            return await anext(texts[i])
        except StopAsyncIteration:
            open_[i] = False
            return None

    try:
        while True:
            step = await gather_or_cancel([next_text(i) for i in range(len(texts))])
            if all(t is None for t in step):
                return
            yield {"outputs": [t or "" for t in step]}
    finally:
        await asyncio.gather(*(t.aclose() for t in texts), return_exceptions=True)
        await asyncio.gather(*(_close(s) for s in streams), return_exceptions=True)


async def _close(stream: AsyncIterator[Event]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def jsonlines(objects: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """``application/jsonlines``: one JSON object per line, no prefix, no terminator."""
    async for obj in objects:
        yield json_bytes(obj) + b"\n"


def sse(objects: AsyncIterator[dict[str, Any]], *, space: bool) -> AsyncIterator[bytes]:
    """Server-sent events without ``[DONE]`` or comments: ``data: `` for LMI (DJL's writer),
    ``data:`` with no space for TGI."""
    return data_events(objects, prefix=b"data: " if space else b"data:")

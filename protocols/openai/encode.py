"""Internal events → OpenAI responses. Streaming encoders are pure async-generator transforms
(events in, chunk dicts out; ``sse`` turns chunks into bytes), testable without a server."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from contract import (
    BacktrackEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    ForkEvent,
    PromptEvent,
    TokenEvent,
    as_error,
    splice_refusal,
)
from protocols.openai.errors import error_body, from_event
from protocols.openai.tool_calls import ChatDeltas, chat_message, tool_finish_reason
from protocols.sse import DONE, data_events
from protocols.streams import fold_splices
from protocols.tools import ToolChoice

__all__ = [
    "ChunkMeta",
    "chat_chunks",
    "chat_response",
    "collect",
    "completion_chunks",
    "completion_response",
    "openai_finish_reason",
    "prompt_scores",
    "sse",
    "with_echo",
    "with_prompt_scores",
]

UsageMode = Literal["none", "final", "continuous"]


@dataclass(frozen=True)
class ChunkMeta:
    id: str
    created: int
    model: str
    n: int = 1  # choices per prompt: prompt usage is counted once per prompt
    prompts: int = 1


def openai_finish_reason(event: FinalEvent) -> str:
    return {"eos": "stop", "stop_sequence": "stop"}.get(event.finish_reason, event.finish_reason)


@dataclass(frozen=True)
class EchoedPrompt:
    """The echoed prompt's logprobs for choice ``index`` (completion-logprobs lists, the first
    position's ``None``: no context), just before that choice's first output, which carries
    the prompt's ``length`` characters at its start."""

    index: int
    length: int
    logprobs: dict


def _prompt_logprobs(prompt: PromptEvent) -> dict:
    lp = _no_logprobs()
    offset = 0
    for i, token in enumerate(prompt.tokens):
        lp["tokens"].append(token.text)
        lp["token_logprobs"].append(_finite(token.logprob))
        lp["top_logprobs"].append({t.text: _finite(t.logprob) for t in token.top_logprobs}
                                  if i else None)
        lp["text_offset"].append(offset)
        offset += len(token.text)
    return lp


async def with_echo(events: AsyncIterator[Event]) -> AsyncIterator[Event | EchoedPrompt]:
    """Prepend the prompt text (from the PromptEvent) to each choice's first output, and before
    it, the prompt's logprobs (``EchoedPrompt``: OpenAI's echo with logprobs lists the prompt
    tokens first, as lm-evaluation-harness's loglikelihood reads them)."""
    prompt: PromptEvent | None = None
    echoed: set[int] = set()
    async for event in events:
        if isinstance(event, PromptEvent):
            prompt = event
        elif prompt is not None and isinstance(event, (TokenEvent, FinalEvent)):
            if event.index not in echoed:
                echoed.add(event.index)
                yield EchoedPrompt(event.index, len(prompt.text), _prompt_logprobs(prompt))
                event = msgspec.structs.replace(event, text=prompt.text + event.text)
        yield event


@dataclass(frozen=True)
class PromptScores:
    """vLLM's ``prompt_logprobs`` field for choices ``indices`` (every choice of one prompt)."""

    indices: range
    entries: list[dict | None]


def _finite(logprob: float | None) -> float | None:
    """JSON has no -inf: a token a controller's mask or a bias ruled out is -9999.0, as vLLM
    writes it (a 500 otherwise: JSON encoding refuses the response)."""
    if logprob is None or math.isfinite(logprob):
        return logprob
    return -9999.0


def prompt_scores(prompt: PromptEvent, k: int) -> list[dict | None]:
    """Per prompt position, vLLM's shape: ``None`` first (no context), then the prompt token
    and the ``k`` most likely, keyed by token id, each with its logprob, rank and text."""
    entries: list[dict | None] = []
    for token in prompt.tokens:
        if token.logprob is None:
            entries.append(None)
            continue
        entry = {str(token.token_id): {"logprob": _finite(token.logprob), "rank": token.rank,
                                       "decoded_token": token.text}}
        for rank, top in enumerate(token.top_logprobs[:k], start=1):  # in the top k: that rank
            entry[str(top.token_id)] = {"logprob": _finite(top.logprob), "rank": rank,
                                        "decoded_token": top.text}
        entries.append(entry)
    return entries


async def with_prompt_scores(events: AsyncIterator[Event], indices: range,
                             k: int) -> AsyncIterator[Event | PromptScores]:
    """Before the prompt event of one prompt's stream, its scores for its choices."""
    async for event in events:
        if isinstance(event, PromptEvent):
            yield PromptScores(indices, prompt_scores(event, k))
        yield event


def _no_logprobs() -> dict[str, list]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _joined(first: dict, then: dict) -> dict:
    return {key: first[key] + then[key] for key in first}


class _UsageCounter:
    """Prompt tokens once per prompt (its first choice); choices past the requested ones are
    forks of a prompt already counted."""

    def __init__(self, n: int, prompts: int):
        self.n = n
        self.requested = n * prompts
        self.prompt = 0
        self.cached = 0  # prompt tokens the engine's prefix cache already held
        self.completion = 0
        self.reasoning = 0  # of completion, a reasoning model's thinking (docs/reasoning.md)

    def token(self) -> None:
        self.completion += 1

    def final(self, event: FinalEvent) -> None:
        self.reasoning += event.usage.reasoning_tokens
        if event.index < self.requested and event.index % self.n == 0:
            self.prompt += event.usage.prompt_tokens
            self.cached += event.usage.cached_tokens

    def as_dict(self) -> dict:
        usage = {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                 "total_tokens": self.prompt + self.completion,
                 "prompt_tokens_details": {"cached_tokens": self.cached}}
        if self.reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning}
        return usage


def _error_chunk(event: ErrorEvent) -> dict:
    exc = from_event(event)
    return error_body(exc.status, exc.message, exc.param)


def _completion_logprobs(event: TokenEvent, offset: int) -> dict:
    token = event.token_text or ""
    return {
        "tokens": [token],
        "token_logprobs": [_finite(event.logprob)],
        "top_logprobs": [{t.text: _finite(t.logprob) for t in event.top_logprobs}],
        "text_offset": [offset],
    }


def _chat_logprob(event: TokenEvent) -> dict:
    token = event.token_text or ""
    return {
        "token": token,
        "logprob": _finite(event.logprob),
        "bytes": list(token.encode()),
        "top_logprobs": [
            {"token": t.text, "logprob": _finite(t.logprob), "bytes": list(t.text.encode())}
            for t in event.top_logprobs
        ],
    }


async def completion_chunks(
    events: AsyncIterator[Event], meta: ChunkMeta, *, logprobs: bool, usage: UsageMode
) -> AsyncIterator[dict]:
    """``text_completion`` chunks: one per token, one per finished choice, then usage."""
    counter = _UsageCounter(meta.n, meta.prompts)
    offsets: dict[int, int] = {}
    echoed: dict[int, EchoedPrompt] = {}
    head = {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model}
    async for event in events:
        if isinstance(event, (ErrorEvent, BacktrackEvent, ForkEvent)):  # a stream only grows
            yield _error_chunk(as_error(event))
            return
        if isinstance(event, EchoedPrompt):
            echoed[event.index] = event
            continue
        if not isinstance(event, (TokenEvent, FinalEvent)):
            continue
        prompt = echoed.pop(event.index, None) if logprobs else None
        if isinstance(event, TokenEvent):
            counter.token()
            offset = offsets.get(event.index, 0)
            offsets[event.index] = offset + len(event.text)
            lp = _completion_logprobs(event, offset + (prompt.length if prompt else 0)) \
                if logprobs else None
            choice = {"index": event.index, "text": event.text,
                      "logprobs": _joined(prompt.logprobs, lp) if prompt and lp else lp,
                      "finish_reason": None}
        elif isinstance(event, FinalEvent):
            counter.final(event)
            choice = {"index": event.index, "text": event.text,
                      "logprobs": prompt.logprobs if prompt else None,
                      "finish_reason": openai_finish_reason(event), "stop_reason": event.stop_reason}
        chunk = {**head, "choices": [choice]}
        if usage == "continuous":
            chunk["usage"] = counter.as_dict()
        yield chunk
    if usage != "none":
        yield {**head, "choices": [], "usage": counter.as_dict()}


async def chat_chunks(
    events: AsyncIterator[Event], meta: ChunkMeta, *, choices: int, logprobs: bool,
    usage: UsageMode, tools: ToolChoice | None = None, reasoning: bool = True
) -> AsyncIterator[dict]:
    """``chat.completion.chunk`` s: a role chunk per choice, a content (or ``tool_calls``, or
    with ``reasoning`` a reasoning model's thinking) chunk per token, a finish chunk per
    choice, then usage. Every chunk with choices has a ``delta``."""
    counter = _UsageCounter(meta.n, meta.prompts)
    head = {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
            "model": meta.model}
    deltas = ChatDeltas(tools)

    def wrap(choice: dict) -> dict:
        chunk = {**head, "choices": [choice]}
        if usage == "continuous":
            chunk["usage"] = counter.as_dict()
        return chunk

    started = False
    async for event in events:
        if isinstance(event, ErrorEvent):
            yield _error_chunk(event)
            return
        if not started:  # only after the peeked first event proved the request valid
            started = True
            for index in range(choices):
                yield wrap({"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})
        if isinstance(event, TokenEvent):
            counter.token()
            lp = {"content": [_chat_logprob(event)]} if logprobs else None
            for delta in _token_deltas(deltas, event, reasoning) or ([{}] if lp else []):
                yield wrap({"index": event.index, "delta": delta, "logprobs": lp,
                            "finish_reason": None})
                lp = None
        elif isinstance(event, FinalEvent):
            counter.final(event)
            last = _thinking(event.reasoning, reasoning) + deltas.text(event.index, event.text,
                                                                       final=True)
            for delta in last[:-1]:
                yield wrap({"index": event.index, "delta": delta, "logprobs": None,
                            "finish_reason": None})
            yield wrap({"index": event.index, "delta": last[-1] if last else {}, "logprobs": None,
                        "finish_reason": deltas.finish_reason(event.index,
                                                              openai_finish_reason(event)),
                        "stop_reason": event.stop_reason})
        elif isinstance(event, (BacktrackEvent, ForkEvent)):  # a stream can't take text back
            yield _error_chunk(splice_refusal(event))
            return
    if usage != "none":
        yield {**head, "choices": [], "usage": counter.as_dict()}


def _thinking(text: str, shown: bool) -> list[dict]:
    """A delta of a reasoning model's thinking, under both names clients read: DeepSeek's
    ``reasoning_content`` and vLLM's ``reasoning`` (docs/reasoning.md)."""
    return [{"reasoning_content": text, "reasoning": text}] if text and shown else []


def _token_deltas(deltas: ChatDeltas, event: TokenEvent, reasoning: bool) -> list[dict]:
    thinking = _thinking(event.reasoning, reasoning)
    if event.reasoning and not event.text:  # a thinking token: no empty content beside it
        return thinking
    return thinking + deltas.text(event.index, event.text)


def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Server-sent events, ``data: <json>\\n\\n`` each, closed by ``data: [DONE]``."""
    return data_events(chunks, done=DONE)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)
    final: FinalEvent | None = None
    echoed: EchoedPrompt | None = None


@dataclass
class Collected:
    choices: dict[int, _Choice]
    usage: dict
    prompt_scores: dict[int, list[dict | None]] = field(default_factory=dict)  # by choice


async def collect(events: AsyncIterator[Event], n: int, prompts: int = 1) -> Collected:
    """Fold a whole event stream for a non-streaming response; an error raises OpenAIError.
    Backtracks are applied; forks become extra choices."""
    choices: dict[int, _Choice] = {}
    scores: dict[int, list[dict | None]] = {}
    counter = _UsageCounter(n, prompts)
    async for event in fold_splices(events):
        if isinstance(event, ErrorEvent):
            raise from_event(event)
        if isinstance(event, PromptScores):
            scores.update(dict.fromkeys(event.indices, event.entries))
        if isinstance(event, EchoedPrompt):
            choices.setdefault(event.index, _Choice()).echoed = event
        elif isinstance(event, TokenEvent):
            counter.token()
            choice = choices.setdefault(event.index, _Choice())
            choice.text.append(event.text)
            choice.reasoning.append(event.reasoning)
            choice.tokens.append(event)
        elif isinstance(event, FinalEvent):
            counter.final(event)
            choice = choices.setdefault(event.index, _Choice())
            choice.text.append(event.text)
            choice.reasoning.append(event.reasoning)
            choice.final = event
    return Collected(choices=dict(sorted(choices.items())), usage=counter.as_dict(),
                     prompt_scores=scores)


def _finish(choice: _Choice) -> tuple[str | None, str | int | None]:
    if choice.final is None:
        return None, None
    return openai_finish_reason(choice.final), choice.final.stop_reason


def completion_response(collected: Collected, meta: ChunkMeta, *, logprobs: bool) -> dict:
    out = []
    for index, choice in collected.choices.items():
        finish, stop_reason = _finish(choice)
        lp = None
        if logprobs:
            # The echoed prompt's entries first; its text starts the first output, so that
            # token's offset is past it.
            first = choice.echoed.logprobs if choice.echoed else _no_logprobs()
            lp = {key: list(values) for key, values in first.items()}  # extended below
            offset = 0
            for i, token in enumerate(choice.tokens):
                echo = choice.echoed.length if choice.echoed and i == 0 else 0
                for key, values in _completion_logprobs(token, offset + echo).items():
                    lp[key].extend(values)
                offset += len(token.text)
        out.append({"index": index, "text": "".join(choice.text), "logprobs": lp,
                    "finish_reason": finish, "stop_reason": stop_reason})
        # vLLM's field, one list per choice (null unless asked for)
        out[-1]["prompt_logprobs"] = collected.prompt_scores.get(index)
    return {"id": meta.id, "object": "text_completion", "created": meta.created,
            "model": meta.model, "choices": out, "usage": collected.usage}


def chat_response(collected: Collected, meta: ChunkMeta, *, logprobs: bool,
                  tools: ToolChoice | None = None, reasoning: bool = True) -> dict:
    out = []
    for index, choice in collected.choices.items():
        finish, stop_reason = _finish(choice)
        message, called = chat_message("".join(choice.text), tools)
        for thinking in _thinking("".join(choice.reasoning), reasoning):
            message.update(thinking)
        out.append({
            "index": index,
            "message": message,
            "logprobs": {"content": [_chat_logprob(t) for t in choice.tokens]} if logprobs else None,
            "finish_reason": tool_finish_reason(finish, called, tools),
            "stop_reason": stop_reason,
        })
    response = {"id": meta.id, "object": "chat.completion", "created": meta.created,
                "model": meta.model, "choices": out, "usage": collected.usage}
    # vLLM's field: the one prompt's, beside the choices (null unless asked for)
    response["prompt_logprobs"] = collected.prompt_scores.get(0)
    return response

"""What an engine kind implements. :class:`engines.replica.host.EngineHost` turns any :class:`Engine`
into the engine contract protocols talk to (:class:`contract.EngineClient`).

The host owns everything that is the same for every kind: admission (``engines.replica.admission``),
the deadline, in-flight/abort accounting and turning unexpected failures into error events. An
engine kind owns its model: prompt rendering, decoding, and the events of admitted requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

import msgspec

from contract import Adapter, Event, GenerateRequest, ModelInfo, Prompt

__all__ = ["Admitted", "Engine", "PromptError", "ReferenceEngine", "ReferenceOutput"]


class PromptError(ValueError):
    """The tokenizer or chat template refused a prompt (becomes a ``validation`` ErrorEvent)."""


class Admitted(msgspec.Struct, frozen=True, kw_only=True):
    """A request that passed admission: its prompt as token ids and the resolved token budget
    (``Sampling.max_tokens``, or the room left in the context when that was ``None``)."""

    prompt_ids: list[int]
    max_tokens: int


class Engine(Protocol):
    """One engine kind's model replica.

    ``stream`` yields the events of an admitted request (stream contract in
    ``contract``); closing or cancelling it must abort the request in the engine.
    Failures the engine can classify (its own admission, overload) are yielded as
    :class:`~contract.ErrorEvent` s; anything raised becomes an ``engine`` error.
    ``tokenizer``: the model's (Hugging Face's interface: ``encode``, ``decode``,
    ``get_vocab``), which a reasoning parser reads its markers from.
    """

    tokenizer: Any

    def model_info(self) -> ModelInfo: ...

    def render(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt`` exactly as ``stream`` will see them; raises PromptError."""
        ...

    def detokenize(self, token_ids: tuple[int, ...]) -> str: ...

    def stream(self, request: GenerateRequest, admitted: Admitted) -> AsyncIterator[Event]: ...

    async def check_health(self) -> None: ...


class ReferenceOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A greedy completion produced without any of the gateway's translation."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    prompt_token_ids: list[int]


@runtime_checkable
class ReferenceEngine(Protocol):
    """Optional: an engine kind that can produce an independent oracle for parity tests (vLLM:
    its own API with its own defaults; a layer-split engine: the unsplit model)."""

    async def reference_greedy(self, prompt: str | list[int], max_tokens: int,
                               adapter: Adapter | None = None) -> ReferenceOutput:
        """``adapter``: with that LoRA adapter (kinds that serve adapters)."""
        ...

"""What protocols may ask of a model's engine (:class:`EngineClient`) and of the gateway's model
registry (:class:`ModelDirectory`); the events an engine yields and their order are the stream
contract of ``contract/events.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from contract.events import Event
from contract.models import EngineStats, ModelInfo
from contract.requests import GenerateRequest, Prompt

__all__ = ["EngineClient", "ModelDirectory"]


class EngineClient(Protocol):
    """What a protocol may ask of a model's engine. Implemented by every engine.

    ``generate`` yields the events of one request (``contract/events.py``'s stream
    contract). Cancelling the iteration (client disconnect) must abort the engine request.
    Validation problems are reported as an :class:`ErrorEvent` first, never raised, so
    protocols can answer with a proper status.
    """

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]: ...

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...]: ...

    async def detokenize(self, token_ids: tuple[int, ...]) -> str: ...

    async def detokenize_each(self, token_ids: tuple[int, ...]) -> tuple[str, ...]:
        """Each id's own text, in one call (``/tokenize``'s token strings)."""
        ...

    async def model_info(self) -> ModelInfo: ...

    async def check_health(self) -> None: ...

    async def stats(self) -> EngineStats: ...


class ModelDirectory(Protocol):
    """Routing by model name, as protocols see it (the gateway's registry implements it).

    ``resolve`` raises :class:`ModelNotFound` or :class:`ModelRequired` (name omitted while
    several models are served); ``info`` is cached per model.
    """

    def names(self) -> list[str]: ...

    def items(self) -> list[tuple[str, EngineClient]]: ...

    def resolve(self, name: str | None) -> tuple[str, EngineClient]: ...

    # LoRA adapters (docs/adapters.md). ``resolve`` takes an adapter's name as a model's;
    # ``resolve_adapter`` runs a model with one of its adapters named apart (TGI's
    # ``adapter_id``), raising :class:`AdapterNotFound`. ``adapters``: ``(adapter, model)``
    # pairs; ``parent``: the model an adapter runs on (None: not an adapter).
    # ``load_adapter`` / ``unload_adapter`` raise :class:`AdapterInvalid`.

    def resolve_adapter(self, name: str | None, adapter: str) -> tuple[str, EngineClient]: ...

    def adapters(self) -> list[tuple[str, str]]: ...

    def parent(self, name: str) -> str | None: ...

    def load_adapter(self, model: str | None, name: str, path: str) -> None: ...

    def unload_adapter(self, model: str | None, name: str) -> bool: ...

    async def info(self, name: str) -> ModelInfo: ...

    async def health(self) -> dict[str, bool]: ...

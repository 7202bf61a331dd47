"""Routing by model name: which engine serves a request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from protocols.contract import EngineClient
from protocols.internal import EngineStats, ModelInfo, ModelNotFound, ModelRequired, Prompt

__all__ = ["EngineWrapper", "ModelRegistry"]


class EngineWrapper:
    """An engine client around ``inner`` (what :meth:`ModelRegistry.with_engines` wraps with):
    everything but ``generate``, which each wrapper defines, goes to ``inner`` unchanged."""

    def __init__(self, inner: EngineClient):
        self.inner = inner

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        return await self.inner.tokenize(prompt)

    async def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return await self.inner.detokenize(token_ids)

    async def detokenize_each(self, token_ids: tuple[int, ...]) -> tuple[str, ...]:
        return await self.inner.detokenize_each(token_ids)

    async def model_info(self) -> ModelInfo:
        return await self.inner.model_info()

    async def check_health(self) -> None:
        await self.inner.check_health()

    async def stats(self) -> EngineStats:
        return await self.inner.stats()


class ModelRegistry:
    """Model name → engine (a :class:`~protocols.internal.ModelDirectory`). With exactly one
    model, an omitted name means that model.

    ``aliases`` map extra names onto served models (clients that hard-code a model name, like
    SGLang's Triton benchmark asking for ``ensemble``); they resolve but are not listed.
    """

    def __init__(self, engines: dict[str, EngineClient], aliases: dict[str, str] | None = None,
                 *, expose_paths: bool = False):
        self._engines = dict(engines)
        self._expose_paths = expose_paths
        self._aliases = dict(aliases or {})
        unknown = sorted(set(self._aliases.values()) - set(self._engines))
        if unknown:
            raise ValueError(f"aliases point at models that are not served: {unknown}")
        self._info: dict[str, ModelInfo] = {}
        self._info_lock = asyncio.Lock()

    def with_engines(self, wrap: Callable[[str, EngineClient], EngineClient]) -> ModelRegistry:
        """The same models and aliases, each engine wrapped (``wrap(name, engine)``: metered
        per API key, measured)."""
        return ModelRegistry({n: wrap(n, e) for n, e in self._engines.items()}, self._aliases,
                             expose_paths=self._expose_paths)

    def names(self) -> list[str]:
        return list(self._engines)

    def items(self) -> list[tuple[str, EngineClient]]:
        """Served models and their engines (aliases excluded)."""
        return list(self._engines.items())

    def resolve(self, name: str | None) -> tuple[str, EngineClient]:
        if not name:
            if len(self._engines) != 1:
                raise ModelRequired()
            name = next(iter(self._engines))
        name = self._aliases.get(name, name)
        engine = self._engines.get(name)
        if engine is None:
            raise ModelNotFound(name)
        return name, engine

    async def health(self) -> dict[str, bool]:
        """Served model → whether its engine answered a health check."""
        served = self.items()
        results = await asyncio.gather(*(e.check_health() for _, e in served),
                                       return_exceptions=True)
        return {n: not isinstance(r, BaseException)
                for (n, _), r in zip(served, results, strict=True)}

    async def info(self, name: str) -> ModelInfo:
        """Model metadata, fetched once per model (it doesn't change while serving)."""
        if name not in self._info:
            async with self._info_lock:
                if name not in self._info:
                    info = await self._engines[name].model_info()
                    if not self._expose_paths:
                        info = msgspec.structs.replace(info, root=name)
                    self._info[name] = info
        return self._info[name]

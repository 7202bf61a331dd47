"""Routing by model name: which engine serves a request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import msgspec

from contract import (
    Adapter,
    AdapterInvalid,
    AdapterNotFound,
    EngineStats,
    Event,
    GenerateRequest,
    ModelInfo,
    ModelNotFound,
    ModelRequired,
    Prompt,
)
from contract.client import EngineClient
from gateway.ingress.adapters import AdapterCatalog

__all__ = ["AdapterEngine", "EngineWrapper", "ModelRegistry"]


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


class AdapterEngine(EngineWrapper):
    """The engine of an adapter's base model, its generations run with that adapter."""

    def __init__(self, inner: EngineClient, adapter: Adapter, base: str):
        super().__init__(inner)
        self.adapter = adapter
        self.base = base

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        return self.inner.generate(msgspec.structs.replace(request, model=self.base,
                                                           adapter=self.adapter))


class ModelRegistry:
    """Model name → engine (a :class:`~contract.ModelDirectory`). With exactly one
    model, an omitted name means that model.

    ``aliases`` map extra names onto served models (clients that hard-code a model name, like
    SGLang's Triton benchmark asking for ``ensemble``); they resolve but are not listed.
    ``adapters``: served model → its LoRA adapters (docs/adapters.md); an adapter's name
    resolves to its model's engine running it, unless a model or alias has that name.
    """

    def __init__(self, engines: dict[str, EngineClient], aliases: dict[str, str] | None = None,
                 *, expose_paths: bool = False,
                 adapters: dict[str, AdapterCatalog] | None = None):
        self._engines = dict(engines)
        self._adapters = {m: c for m, c in (adapters or {}).items() if m in self._engines}
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
                             expose_paths=self._expose_paths, adapters=self._adapters)

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
        if engine is not None:
            return name, engine
        for model, catalog in self._adapters.items():
            adapter = catalog.find(name)
            if adapter is not None:
                return name, AdapterEngine(self._engines[model], adapter, model)
        raise ModelNotFound(name)

    def resolve_adapter(self, name: str | None, adapter: str) -> tuple[str, EngineClient]:
        """Model ``name`` (as :meth:`resolve`) running its adapter ``adapter``: the name
        answered is the model's. :class:`AdapterNotFound` if it has no such adapter."""
        name, engine = self.resolve(name)
        base = engine.base if isinstance(engine, AdapterEngine) else name
        catalog = self._adapters.get(base)
        found = catalog.find(adapter) if catalog is not None else None
        if found is None:
            raise AdapterNotFound(base, adapter)
        inner = engine.inner if isinstance(engine, AdapterEngine) else engine
        return name, AdapterEngine(inner, found, base)

    def adapters(self) -> list[tuple[str, str]]:
        """Every adapter served, with its model: ``(adapter, model)``; names that a model or
        alias takes are left out (they resolve to it)."""
        taken = set(self._engines) | set(self._aliases)
        return [(name, model) for model, catalog in self._adapters.items()
                for name in catalog.names() if name not in taken]

    def parent(self, name: str) -> str | None:
        """The model an adapter's name runs on (None: ``name`` is not an adapter's)."""
        _, engine = self.resolve(name)
        return engine.base if isinstance(engine, AdapterEngine) else None

    def load_adapter(self, model: str | None, name: str, path: str) -> None:
        """Serve the adapter in folder ``path`` as ``name`` on ``model`` (None: the only
        model with adapters), in every process from now on (``AdapterCatalog.link``)."""
        if name in self._engines or name in self._aliases:
            raise AdapterInvalid(f"`{name}` is a model's name; an adapter needs its own")
        self._catalog(model).link(name, path)

    def unload_adapter(self, model: str | None, name: str) -> bool:
        """Stop serving adapter ``name`` loaded at runtime (False: there was none)."""
        return self._catalog(model).unlink(name)

    def _catalog(self, model: str | None) -> AdapterCatalog:
        if model is None:
            if not self._adapters:
                raise AdapterInvalid("no model here serves LoRA adapters (no `lora` entry)")
            if len(self._adapters) > 1:
                raise ModelRequired()
            return next(iter(self._adapters.values()))
        model = self._aliases.get(model, model)
        if model in self._adapters:
            return self._adapters[model]
        if model in self._engines:
            raise AdapterInvalid(f"model `{model}` serves no LoRA adapters (no `lora` entry)")
        raise ModelNotFound(model)

    async def health(self) -> dict[str, bool]:
        """Served model → whether its engine answered a health check."""
        served = self.items()
        results = await asyncio.gather(*(e.check_health() for _, e in served),
                                       return_exceptions=True)
        return {n: not isinstance(r, BaseException)
                for (n, _), r in zip(served, results, strict=True)}

    async def info(self, name: str) -> ModelInfo:
        """Model metadata, fetched once per model (it doesn't change while serving); an
        adapter's is its model's under the adapter's name."""
        if name not in self._engines:
            _, engine = self.resolve(name)
            if isinstance(engine, AdapterEngine):
                base = await self.info(engine.base)
                return msgspec.structs.replace(base, name=name)
            name = self._aliases.get(name, name)
        if name not in self._info:
            async with self._info_lock:
                if name not in self._info:
                    info = await self._engines[name].model_info()
                    if not self._expose_paths:
                        info = msgspec.structs.replace(info, root=name)
                    self._info[name] = info
        return self._info[name]

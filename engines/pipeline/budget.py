"""The pipeline's KV-cache budget (docs/protocols/pipeline.md, "Bounds"): tokens of cache that every
stage may hold, all sequences together. A request reserves its longest possible length (prompt
plus ``max_tokens``, per choice) before it starts, waits in order while that does not fit, and
is refused as overloaded when too many wait: a stage never grows past its budget, whatever the
load, instead of being killed for memory."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["BudgetFull", "KVBudget", "NeverFits", "bytes_per_token", "tokens_for"]


class NeverFits(ValueError):
    """The request alone needs more than the whole budget."""


class BudgetFull(RuntimeError):
    """Too many requests already wait for the budget."""


def bytes_per_token(text_config: Any, layers: int, dtype_bytes: int) -> int:
    """Bytes of keys and values one token takes in ``layers`` layers."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return 2 * kv_heads * head_dim * dtype_bytes * max(layers, 1)


def tokens_for(gib: float, text_config: Any, layers: int, dtype_bytes: int) -> int:
    """How many tokens of keys and values ``layers`` layers hold in ``gib`` GiB."""
    return int(gib * (1 << 30)) // bytes_per_token(text_config, layers, dtype_bytes)


class KVBudget:
    """``tokens`` of cache per stage; at most ``max_waiting`` requests wait for them, first come
    first served (a large request is not passed by smaller ones forever)."""

    def __init__(self, tokens: int, max_waiting: int):
        self.tokens = self.free = tokens
        self.max_waiting = max_waiting
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()

    @contextlib.asynccontextmanager
    async def reserve(self, need: int) -> AsyncIterator[None]:
        if need > self.tokens:
            raise NeverFits(f"the request needs {need} tokens of KV cache; this model's stages "
                            f"hold {self.tokens} (lower max_tokens or n)")
        if self._waiting or need > self.free:
            await self._wait(need)
        else:
            self.free -= need
        try:
            yield
        finally:
            self.free += need
            self._grant()

    async def _wait(self, need: int) -> None:
        if len(self._waiting) >= self.max_waiting:
            raise BudgetFull(f"{len(self._waiting)} requests already wait for KV cache")
        granted = asyncio.get_running_loop().create_future()
        entry = (need, granted)
        self._waiting.append(entry)
        try:
            await granted
        except BaseException:
            if granted.done() and not granted.cancelled():  # granted, then cancelled: give back
                self.free += need
            with contextlib.suppress(ValueError):
                self._waiting.remove(entry)
            self._grant()
            raise

    def _grant(self) -> None:
        while self._waiting and self._waiting[0][0] <= self.free:
            need, granted = self._waiting.popleft()
            if granted.done():  # its waiter left already
                continue
            self.free -= need
            granted.set_result(None)

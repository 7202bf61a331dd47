"""LoRA adapters on vLLM (docs/adapters.md): the engine arguments that enable them, and each
request's adapter as vLLM's ``LoRARequest``, checked and loaded once per replica before its
first request runs.

On vLLM's CPU backend a base-model request batched with adapter requests ran with an adapter's
weights: its LoRA kernels (``vllm.lora.ops.torch_ops``) index the slots with the request's
slot number, and "no adapter" is -1, which Python reads as the last slot (the GPU kernels skip
it). Seen in the adapter e2e test: three of four base answers under mixed load were another
adapter's. There, base requests run with an adapter whose factors are zero, in a slot of its
own (``max_loras`` one more than ``lora.max_loaded``).

vLLM keeps ``max_loras`` adapters in the batch's slots and ``max_cpu_loras`` in memory, least
recently used first out, and loads one from its directory on demand. An adapter that fails to
load inside a step would fail the engine: loading it first through ``add_lora`` (an engine
call whose failure comes back as an exception) refuses a broken adapter in the protocol's shape
and leaves the replica serving.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from typing import Any

from contract import Adapter
from engines.kit.config import Lora
from engines.kit.lora import (
    AdapterInvalid,
    check_fits,
    model_shapes,
    read_adapter,
    write_zero_adapter,
)

__all__ = ["VLLMAdapters", "lora_engine_args", "needs_base_slot"]

log = logging.getLogger(__name__)

# The zero adapter's name and id: apart from requests' adapters (ids from 1) and the oracle's.
BASE_ADAPTER = "llm-gateway-base"
BASE_ADAPTER_ID = 1 << 29
# The ranks vLLM sizes its LoRA buffers for (vllm.config.lora.MaxLoRARanks).
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_engine_args(lora: Lora, base_slot: bool) -> dict[str, Any]:
    """vLLM's LoRA arguments for ``lora`` (the model's ``engine_args`` may still set others,
    ``max_cpu_loras`` for one): its rank bound rounded up to a size vLLM supports;
    ``base_slot``: one more slot, for base-model requests' zero adapter (module docstring)."""
    rank = next((r for r in _VLLM_RANKS if r >= lora.max_rank), None)
    if rank is None:
        raise ValueError(f"lora.max_rank {lora.max_rank} is over vLLM's largest "
                         f"({_VLLM_RANKS[-1]})")
    slots = lora.max_loaded + int(base_slot)
    return {"enable_lora": True, "max_loras": slots, "max_cpu_loras": slots,
            "max_lora_rank": rank}


def needs_base_slot() -> bool:
    """Whether base-model requests need the zero adapter (vLLM's CPU backend)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VLLMAdapters:
    """Adapters by name → ``LoRARequest``s of one ``AsyncLLM``. An id stands for one (name,
    directory, version): an adapter linked anew under its old name gets a new id, and the old
    one is removed from the engine."""

    def __init__(self, llm: Any, lora: Lora, base_slot: bool):
        self._llm = llm
        self._lora = lora
        self._shapes = model_shapes(llm.model_config.hf_config)
        self._base_slot = base_slot and self._shapes is not None
        self._base: Any = None  # the zero adapter's LoRARequest, once loaded
        self._base_loading: asyncio.Task | None = None
        self._loaded: dict[str, tuple[Adapter, Any]] = {}  # name -> (adapter, LoRARequest)
        self._loading: dict[Adapter, asyncio.Task] = {}
        self._next_id = 1

    async def request_for(self, adapter: Adapter | None):
        """The ``LoRARequest`` of ``adapter``, loaded; :class:`AdapterInvalid` if it cannot be.
        None (the base model): None, or the zero adapter where needed (module docstring)."""
        if adapter is None:
            return (self._base or await self._load_base()) if self._base_slot else None
        known = self._loaded.get(adapter.name)
        if known is not None and known[0] == adapter:
            return known[1]
        task = self._loading.get(adapter)
        if task is None:  # one load per adapter, however many requests wait for it
            task = self._loading[adapter] = asyncio.ensure_future(self._load(adapter))
            task.add_done_callback(lambda _: self._loading.pop(adapter, None))
        return await asyncio.shield(task)

    async def _load_base(self):
        """The zero adapter, written and loaded (once)."""
        if self._base_loading is None:
            self._base_loading = asyncio.ensure_future(self._add_base())
        try:
            self._base = await asyncio.shield(self._base_loading)
        except Exception as exc:  # base requests then run as vLLM runs them
            log.warning("the zero adapter for base requests did not load: %r", exc)
            self._base_slot = False
        return self._base

    async def _add_base(self):
        from vllm.lora.request import LoRARequest

        folder = tempfile.mkdtemp(prefix="llm-gateway-zero-lora-")
        await asyncio.to_thread(write_zero_adapter, folder, self._shapes)
        request = LoRARequest(BASE_ADAPTER, BASE_ADAPTER_ID, folder)
        # Not pinned: a pinned adapter in vLLM's cache failed the engine under mixed load
        # (an adapter of the batch was evicted to make room, KeyError in its slot mapping);
        # evicted, it is read again from its folder like any other.
        await self._llm.add_lora(request)
        return request

    def _check(self, adapter: Adapter) -> None:
        """The folder's checks, its files read (blocking: off the event loop)."""
        read_adapter(adapter.name, adapter.path, self._lora.max_rank)
        if self._shapes is not None:
            check_fits(adapter.name, adapter.path, self._shapes)

    async def _load(self, adapter: Adapter):
        from vllm.lora.request import LoRARequest

        await asyncio.to_thread(self._check, adapter)
        lora_id, self._next_id = self._next_id, self._next_id + 1
        request = LoRARequest(adapter.name, lora_id, adapter.path)
        try:
            await self._llm.add_lora(request)
        except Exception as exc:  # vLLM's loader: shapes, modules, files (logged, not shown)
            log.warning("adapter %s (%s) failed to load: %r", adapter.name, adapter.path, exc)
            raise AdapterInvalid(f"adapter `{adapter.name}` does not load on this model (its "
                                 "weights do not fit it: another base model?)") from None
        previous = self._loaded.get(adapter.name)
        self._loaded[adapter.name] = (adapter, request)
        if previous is not None:
            await self._llm.remove_lora(previous[1].lora_int_id)
        return request

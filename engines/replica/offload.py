"""CPU-heavy calls of an engine replica (tokenizing large prompts) on threads of their own.

The engine replica's event loop also carries every stream's tokens (vLLM's output handler runs
on it): a call that holds it for a second stalls every stream for a second. Hugging Face's
fast tokenizers release the GIL while they encode, so a thread is enough. The threads are few
and the calls waiting for them bounded: beyond that, :class:`Busy` (the request is refused as
overloaded, never queued without bound).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["Busy", "Offload"]

T = TypeVar("T")


class Busy(RuntimeError):
    """Every offload thread is taken and the waiting line is full."""


class Offload:
    """Run calls on ``threads`` threads, with at most ``max_waiting`` more waiting for one.

    A slot is released when the call itself ends, not when its caller stops waiting (a
    cancelled request's tokenization still occupies its thread until it is done).
    """

    def __init__(self, threads: int = 1, max_waiting: int = 16, name: str = "offload"):
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._slots = threading.BoundedSemaphore(threads + max_waiting)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if not self._slots.acquire(blocking=False):
            raise Busy("too many large prompts are being tokenized")
        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        return await asyncio.wrap_future(future)

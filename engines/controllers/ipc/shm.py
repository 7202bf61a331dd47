"""The aicirt transport: JSON messages and logit biases in POSIX shared memory.

Wire format (``docs/protocols/controller-runtime.md``, "Shared-memory transport"), as aicirt
defines it, so either end can be a conforming external program:

- A *slot* carries one message at a time in one direction: shared-memory object
  ``<name>-shm`` holding a ``u32`` little-endian byte length and that many bytes of UTF-8 JSON
  at offset 0, and two POSIX named semaphores, ``<name>-wr`` (1 while the slot is free) and
  ``<name>-rd`` (1 while a message waits).
- The **main** channel (slots ``<prefix>cmd`` and ``<prefix>resp``) is synchronous: the engine
  sends one command and reads its answer before the next one.
- The **side** channel (``<prefix>cmd-side`` / ``<prefix>resp-side``) carries many requests at
  once; each has a ``$rid`` that its answer echoes, and answers may come in any order.
- Biases travel apart from JSON: a dense ``float32[num_seqs, vocab]`` matrix at byte offset 0 of
  ``<prefix>bin-shm``, row *i* for ``mid_process.ops[i]``. Nothing is pickled per step.

The channels' ends (clients and servers) are ``engines/controllers/ipc/channels.py``. The engine end
creates every object (removing stale ones a crashed run left) and removes them
when it closes, as AICI's own engine side does; the runtime end opens them. Every wait has a
bound: a runtime that does not answer costs a timeout, never a hung engine step.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import posix_ipc

__all__ = [
    "DEFAULT_PREFIX", "BiasMatrix", "ChannelClosed", "ChannelObjects", "ChannelError", "ChannelFull",
    "ChannelTimeout", "MessageSlot", "pair",
]

# AICI's default; macOS caps these names at 31 characters, so prefixes stay short.
DEFAULT_PREFIX = "/aici0-"
_LEN = struct.Struct("<I")


class ChannelError(RuntimeError):
    """The transport failed: the other end is gone, out of step, or sent garbage."""


class ChannelTimeout(ChannelError, TimeoutError):
    """The other end did not take or give a message within the bound."""


class ChannelClosed(ChannelError):
    """This end was closed while waiting."""


class ChannelFull(ChannelError):
    """Too many side requests are waiting for answers (the bound on the fan-out)."""


def _map_shm(name: str, size: int, create: bool) -> mmap.mmap:
    if create:
        _unlink(posix_ipc.unlink_shared_memory, name)
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
    else:
        shm = posix_ipc.SharedMemory(name)
        size = shm.size
    try:
        return mmap.mmap(shm.fd, size)
    finally:
        shm.close_fd()


def _semaphore(name: str, initial: int, create: bool) -> posix_ipc.Semaphore:
    if not create:
        return posix_ipc.Semaphore(name)
    _unlink(posix_ipc.unlink_semaphore, name)
    return posix_ipc.Semaphore(name, posix_ipc.O_CREX, initial_value=initial)


def _unlink(unlink: Callable[[str], None], name: str) -> None:
    try:
        unlink(name)
    except posix_ipc.ExistentialError:
        pass


class MessageSlot:
    """One direction of one channel: a message at a time, handed over by two semaphores."""

    def __init__(self, name: str, size: int = 0, *, create: bool) -> None:
        if create and size <= _LEN.size:
            raise ValueError(f"a slot of {size} bytes holds no message")
        self.name = name
        self._owner = create
        self._map = _map_shm(name + "-shm", size, create)
        self._wr = _semaphore(name + "-wr", 1, create)
        self._rd = _semaphore(name + "-rd", 0, create)
        self.capacity = len(self._map) - _LEN.size
        self._closed = False
        # Threads inside send/recv: close() must not free a semaphore one of them waits on
        # (sem_close under a waiter is undefined behaviour; here it crashed the process).
        self._inside = 0
        self._idle = threading.Condition()
        self._waited: set[posix_ipc.Semaphore] = set()

    @contextlib.contextmanager
    def _op(self, sem: posix_ipc.Semaphore, timeout: float | None, what: str) -> Iterator[None]:
        with self._idle:
            if self._closed:
                raise ChannelClosed(f"{self.name}: closed")
            # Each semaphore of a slot is waited on by one end only (``wr`` by the writer, ``rd``
            # by the reader), so close() can wake this end's waiters without waking the other.
            self._waited.add(sem)
            self._inside += 1
        try:
            try:
                sem.acquire(timeout)
            except posix_ipc.BusyError:
                raise ChannelTimeout(f"{self.name}: no {what} within {timeout} s") from None
            if self._closed:  # woken by close(), not by the other end
                raise ChannelClosed(f"{self.name}: closed")
            yield
        finally:
            with self._idle:
                self._inside -= 1
                self._idle.notify_all()

    def send(self, payload: bytes, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` s) until the slot is free, then put ``payload`` in it."""
        if len(payload) > self.capacity:
            raise ValueError(f"{self.name}: message of {len(payload)} bytes exceeds the "
                             f"slot's {self.capacity}")
        with self._op(self._wr, timeout, "free slot"):
            self._map[:_LEN.size] = _LEN.pack(len(payload))
            self._map[_LEN.size:_LEN.size + len(payload)] = payload
            self._rd.release()

    def recv(self, timeout: float | None = None) -> bytes:
        """Wait (at most ``timeout`` s) for a message, take it and free the slot."""
        with self._op(self._rd, timeout, "message"):
            (length,) = _LEN.unpack_from(self._map, 0)
            payload = self._map[_LEN.size:_LEN.size + min(length, self.capacity)]
            self._wr.release()
        if length > self.capacity:
            raise ChannelError(f"{self.name}: length {length} exceeds the slot's {self.capacity}")
        return payload

    def close(self, wait: float = 5.0) -> None:
        """Wake whoever waits on this end (they get :class:`ChannelClosed`), then release the
        mapping and the semaphores, and remove the objects if this end created them."""
        with self._idle:
            if self._closed:
                return
            self._closed = True
            for sem in self._waited:
                sem.release()
            # A woken waiter leaves at once; one that does not within ``wait`` keeps its
            # handles (leaked, not freed under it).
            left = self._idle.wait_for(lambda: self._inside == 0, wait)
        if self._owner:
            _unlink(posix_ipc.unlink_shared_memory, self.name + "-shm")
            for sem in (self._rd, self._wr):
                _unlink(posix_ipc.unlink_semaphore, sem.name)
        if left:
            self._map.close()
            self._rd.close()
            self._wr.close()


class BiasMatrix:
    """``<prefix>bin-shm``: the dense ``float32[num_seqs, vocab]`` bias rows at offset 0."""

    def __init__(self, prefix: str, size: int = 0, *, create: bool) -> None:
        self.name = prefix + "bin-shm"
        self._owner = create
        self._map = _map_shm(self.name, size, create)

    def rows(self, num_seqs: int, vocab: int) -> np.ndarray:
        """A writable view of the first ``num_seqs`` rows (no copy)."""
        if num_seqs * vocab * 4 > len(self._map):
            raise ValueError(f"{num_seqs} rows of {vocab} float32 exceed {self.name}'s "
                             f"{len(self._map)} bytes")
        return np.frombuffer(self._map, np.float32, num_seqs * vocab).reshape(num_seqs, vocab)

    def words(self, num_seqs: int, vocab: int) -> np.ndarray:
        """Beyond the seed, when the engine asks for it: the same region as allowed-token
        bitmasks, ``uint32[num_seqs, ceil(vocab / 32)]`` (bit ``t % 32`` of word ``t // 32``;
        llguidance's layout), 1/32 of the dense rows' bytes."""
        width = (vocab + 31) // 32
        if num_seqs * width * 4 > len(self._map):
            raise ValueError(f"{num_seqs} bitmasks of {vocab} bits exceed {self.name}'s "
                             f"{len(self._map)} bytes")
        return np.frombuffer(self._map, np.uint32, num_seqs * width).reshape(num_seqs, width)

    def close(self) -> None:
        # Views handed out keep the buffer exported; drop them before closing.
        try:
            self._map.close()
        except BufferError:
            pass
        if self._owner:
            _unlink(posix_ipc.unlink_shared_memory, self.name)


def pair(prefix: str, suffix: str, size: int, create: bool) -> tuple[MessageSlot, MessageSlot]:
    cmd = MessageSlot(prefix + "cmd" + suffix, size, create=create)
    try:
        return cmd, MessageSlot(prefix + "resp" + suffix, size, create=create)
    except BaseException:
        cmd.close()
        raise


class ChannelObjects:
    """Every object of one engine/runtime pair, created (stale ones replaced) and, on
    :meth:`close`, removed. The process that owns the pair holds this; the processes that use
    it (the vLLM worker's hook, the runtime, the frontend) open their ends by ``prefix``."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, json_size: int = 8 << 20,
                 bin_size: int = 64 << 20) -> None:
        self.prefix = prefix
        self._parts: list[Any] = []
        try:
            for suffix in ("", "-side"):
                self._parts += pair(prefix, suffix, json_size, create=True)
            self._parts.append(BiasMatrix(prefix, bin_size, create=True))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for part in self._parts:
            part.close()
        self._parts = []

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

The engine end creates every object (removing stale ones a crashed run left) and removes them
when it closes, as AICI's own engine side does; the runtime end opens them. Every wait has a
bound: a runtime that does not answer costs a timeout, never a hung engine step.
"""

from __future__ import annotations

import contextlib
import heapq
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import msgspec
import numpy as np
import posix_ipc

from engines.controllers.messages import BadMessage, Reply, read

__all__ = [
    "DEFAULT_PREFIX", "BiasMatrix", "ChannelClosed", "ChannelObjects", "ChannelError", "ChannelFull",
    "ChannelTimeout", "MainClient", "MainServer", "MessageSlot", "RuntimeReplyError",
    "SideClient", "SideServer", "error_reply", "ok_reply",
]

# AICI's default; macOS caps these names at 31 characters, so prefixes stay short.
DEFAULT_PREFIX = "/aici0-"
_LEN = struct.Struct("<I")
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class ChannelError(RuntimeError):
    """The transport failed: the other end is gone, out of step, or sent garbage."""


class ChannelTimeout(ChannelError, TimeoutError):
    """The other end did not take or give a message within the bound."""


class ChannelClosed(ChannelError):
    """This end was closed while waiting."""


class ChannelFull(ChannelError):
    """Too many side requests are waiting for answers (the bound on the fan-out)."""


class RuntimeReplyError(RuntimeError):
    """The runtime answered ``{"type": "error", ...}``."""

    def __init__(self, message: str, is_user_error: bool = False) -> None:
        super().__init__(message)
        self.is_user_error = is_user_error


def ok_reply(data: Any) -> dict:
    return {"type": "ok", "data": data}


def error_reply(message: str, is_user_error: bool = False) -> dict:
    return {"type": "error", "error": message, "is_user_error": is_user_error}


def _settle(fut: Future, value: Any = None, error: BaseException | None = None) -> None:
    """Answer a side request, unless its caller gave up on it: an awaiting task that is
    cancelled (a client disconnect) cancels the future, and setting a cancelled future raises,
    which killed the thread that does it (the reader, then every later request timed out)."""
    if not fut.set_running_or_notify_cancel():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _unwrap(reply: dict) -> Any:
    try:
        answer = read(reply, Reply)
    except BadMessage as exc:
        raise RuntimeReplyError(f"unreadable answer from the runtime: {exc}") from None
    if answer.type == "ok":
        return answer.data
    raise RuntimeReplyError(answer.error or "the runtime answered an error", answer.is_user_error)


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


def _pair(prefix: str, suffix: str, size: int, create: bool) -> tuple[MessageSlot, MessageSlot]:
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
                self._parts += _pair(prefix, suffix, json_size, create=True)
            self._parts.append(BiasMatrix(prefix, bin_size, create=True))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for part in self._parts:
            part.close()
        self._parts = []


class MainClient:
    """Engine end of the main channel: one command in flight, each answered before the next.

    ``call`` sends and waits; ``send`` and ``receive`` split it, so the engine can start a
    step's command and do other work (its forward pass) before it needs the answer, as AICI
    runs ``mid_process`` beside the forward pass. A command whose answer does not come within
    its bound leaves the channel out of step (the late answer would be read as the next
    command's), so the client refuses further commands until it is closed and a new runtime is
    connected."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, size: int = 8 << 20,
                 create: bool = True) -> None:
        # ``create=False``: another process of the engine end made the objects (the replica
        # does, before the vLLM worker that holds this client starts).
        self._cmd, self._resp = _pair(prefix, "", size, create=create)
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._sent: str | None = None  # the op whose answer is owed

    @property
    def waiting(self) -> bool:
        """A command was sent and its answer not yet received."""
        return self._sent is not None

    def call(self, op: str, timeout: float, **fields: Any) -> Any:
        """Send ``{"op": op, **fields}``; the answer's ``data``, or :class:`RuntimeReplyError`."""
        with self._lock:
            self._send(op, timeout, fields)
            return self._receive(timeout)

    def send(self, op: str, timeout: float, **fields: Any) -> None:
        """Start a command; :meth:`receive` waits for its answer (one in flight)."""
        with self._lock:
            self._send(op, timeout, fields)

    def receive(self, timeout: float) -> Any:
        """The answer to the command :meth:`send` started, as :meth:`call` returns it."""
        with self._lock:
            return self._receive(timeout)

    def _send(self, op: str, timeout: float, fields: dict) -> None:
        if self._broken:
            raise ChannelError(self._broken)
        if self._sent is not None:
            raise ChannelError(f"main channel: {op!r} sent before the answer to "
                               f"{self._sent!r} was received")
        self._cmd.send(_encode({"op": op, **fields}), timeout)
        self._sent = op

    def _receive(self, timeout: float) -> Any:
        op, self._sent = self._sent, None
        if op is None:
            raise ChannelError("main channel: nothing was sent to answer")
        if self._broken:
            raise ChannelError(self._broken)
        try:
            raw = self._resp.recv(timeout)
        except ChannelTimeout as exc:
            self._broken = f"main channel out of step after {op!r} timed out: {exc}"
            raise
        try:
            reply = _decode(raw)
        except msgspec.DecodeError as exc:
            self._broken = f"main channel: unreadable answer to {op!r}: {exc}"
            raise ChannelError(self._broken) from None
        return _unwrap(reply)

    def close(self) -> None:
        self._broken = self._broken or "closed"
        self._cmd.close()
        self._resp.close()


class _ServerEnd:
    """The runtime end of one channel: commands in, answers out."""

    def __init__(self, prefix: str, suffix: str) -> None:
        self._cmd, self._resp = _pair(prefix, suffix, 0, create=False)

    def _incoming(self) -> Iterator[bytes]:
        """Each command as it comes, until :meth:`close`."""
        while True:
            try:
                yield self._cmd.recv()
            except ChannelClosed:
                return

    def close(self) -> None:
        self._cmd.close()
        self._resp.close()


class MainServer(_ServerEnd):
    """Runtime end of the main channel: answers each command with ``handler(command)``."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(prefix, "")
        self._finishing = False

    def finish(self) -> None:
        """Called by a handler: answer the command it is handling, then stop serving. (Closing
        from inside the handler would race the close against that answer.)"""
        self._finishing = True

    def serve(self, handler: Callable[[dict], dict], reply_timeout: float = 10.0) -> None:
        """Until :meth:`close` or :meth:`finish`. A handler's exception becomes an error
        reply, so the engine always gets an answer and the channel stays in step."""
        for raw in self._incoming():
            try:
                self._resp.send(_encode(_handle(handler, raw)), reply_timeout)
            except ChannelClosed:  # closed while the handler ran
                return
            if self._finishing:
                return


def _handle(handler: Callable[[dict], dict], raw: bytes) -> dict:
    try:
        command = _decode(raw)
    except msgspec.DecodeError as exc:
        return error_reply(f"json-error: {exc}", is_user_error=True)
    if not isinstance(command, dict) or not isinstance(command.get("op"), str):
        return error_reply("a command is a JSON object with a string 'op'", is_user_error=True)
    try:
        return handler(command)
    except Exception as exc:  # any handler failure is answered, not raised
        return error_reply(f"{type(exc).__name__}: {exc}")


class SideClient:
    """Engine end of the side channel: many requests in flight, matched to answers by ``$rid``.

    A reader thread takes answers as they come; each request is a ``concurrent.futures.Future``
    (``asyncio.wrap_future`` for async callers). At most ``max_pending`` wait at once."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, size: int = 8 << 20,
                 max_pending: int = 256, create: bool = True) -> None:
        self._cmd, self._resp = _pair(prefix, "-side", size, create=create)
        self._max_pending = max_pending
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()  # guards _pending and the order of sends
        self._reader = threading.Thread(target=self._read, name="aici-side-reader", daemon=True)
        self._reader.start()
        # The bound on each answer: one thread over a heap of deadlines (a timer thread per
        # request cost a thread start per instantiate / advance / release), so nothing polls.
        self._deadlines: list[tuple[float, str, str, float]] = []
        self._due = threading.Condition()
        self._expirer = threading.Thread(target=self._expire_due, name="aici-side-timeouts",
                                         daemon=True)
        self._expirer.start()

    def request(self, op: str, auth: dict | None = None, timeout: float = 10.0,
                **fields: Any) -> Future:
        """Send ``op`` now; the future resolves to the answer's ``data`` (or raises
        :class:`RuntimeReplyError`, :class:`ChannelTimeout`, :class:`ChannelClosed`)."""
        rid = os.urandom(8).hex()
        fut: Future = Future()
        message = {"op": op, **fields, "$rid": rid}
        if auth is not None:
            message["$auth"] = auth
        payload = _encode(message)
        with self._lock:
            if len(self._pending) >= self._max_pending:
                raise ChannelFull(f"{len(self._pending)} side requests already wait")
            self._pending[rid] = fut
            try:
                self._cmd.send(payload, timeout)
            except BaseException:
                self._pending.pop(rid, None)
                raise
        with self._due:
            heapq.heappush(self._deadlines, (time.monotonic() + timeout, rid, op, timeout))
            if self._deadlines[0][1] == rid:  # the earliest now: the expirer waits less
                self._due.notify()
        return fut

    def call(self, op: str, auth: dict | None = None, timeout: float = 10.0, **fields: Any) -> Any:
        """:meth:`request`, waiting for the answer."""
        return self.request(op, auth, timeout, **fields).result()

    def _expire_due(self) -> None:
        while True:
            with self._due:
                while not self._deadlines or self._deadlines[0][0] > time.monotonic():
                    wait = self._deadlines[0][0] - time.monotonic() if self._deadlines else None
                    self._due.wait(wait)
                _, rid, op, timeout = heapq.heappop(self._deadlines)
            if not rid:  # closed
                return
            with self._lock:
                fut = self._pending.pop(rid, None)  # None: answered (or closed) already
            if fut is not None:
                _settle(fut, error=ChannelTimeout(f"side {op!r} not answered within {timeout} s"))

    def _read(self) -> None:
        while True:
            try:
                raw = self._resp.recv()
            except ChannelClosed:
                break
            try:
                reply = _decode(raw)
                rid = reply.pop("$rid")
            except (msgspec.DecodeError, AttributeError, KeyError, TypeError):
                continue  # an answer nobody can claim; its request times out
            with self._lock:
                fut = self._pending.pop(rid, None)
            if fut is None:  # timed out already, or never ours
                continue
            try:
                _settle(fut, _unwrap(reply))
            except RuntimeReplyError as exc:
                _settle(fut, error=exc)
        with self._lock:
            waiting, self._pending = list(self._pending.values()), {}
        for fut in waiting:
            _settle(fut, error=ChannelClosed("side channel closed"))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._cmd.close()
        self._resp.close()
        self._reader.join(5)
        with self._due:
            self._deadlines = [(0.0, "", "", 0.0)]  # the expirer's signal to stop
            self._due.notify()
        self._expirer.join(5)


class SideServer(_ServerEnd):
    """Runtime end of the side channel.

    ``handler(request, reply)`` is called on the reader thread for each request; it may call
    ``reply(answer)`` right away or later from any thread (answers may go out of order), and
    exactly once. The answer gets the request's ``$rid``."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(prefix, "-side")
        self._send_lock = threading.Lock()

    def serve(self, handler: Callable[[dict, Callable[[dict], None]], None],
              reply_timeout: float = 10.0) -> None:
        for raw in self._incoming():
            try:
                request = _decode(raw)
                rid = request.get("$rid")
            except (msgspec.DecodeError, AttributeError):
                continue  # no $rid to answer to; the engine's request times out
            reply = self._replier(rid, reply_timeout)
            if not isinstance(request.get("op"), str):
                reply(error_reply("a side request has a string 'op'", is_user_error=True))
                continue
            try:
                handler(request, reply)
            except Exception as exc:  # answered; the channel keeps serving
                reply(error_reply(f"{type(exc).__name__}: {exc}"))

    def _replier(self, rid: Any, timeout: float) -> Callable[[dict], None]:
        sent = threading.Event()

        def reply(answer: dict) -> None:
            if sent.is_set():
                return
            sent.set()
            with self._send_lock:
                try:
                    self._resp.send(_encode({**answer, "$rid": rid}), timeout)
                except ChannelClosed:
                    pass
        return reply

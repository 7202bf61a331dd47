"""The two channels' ends over the shared-memory slots of ``engines/controllers/ipc/shm.py``: the
engine's clients (main: one command at a time; side: many requests, answered by ``$rid`` in any
order, bounded in flight) and the runtime's servers, and the answers' envelope
(``docs/protocols/controller-runtime.md``, "Shared-memory transport")."""

from __future__ import annotations

import heapq
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import msgspec

from engines.controllers.ipc.messages import Addressed, BadMessage, Failure, Ok, Op, Reply, read
from engines.controllers.ipc.shm import (
    DEFAULT_PREFIX,
    ChannelClosed,
    ChannelError,
    ChannelFull,
    ChannelTimeout,
    pair,
)

__all__ = ["MainClient", "MainServer", "RuntimeReplyError", "SideClient", "SideServer",
           "error_reply", "ok_reply"]

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_decode_reply = msgspec.json.Decoder(Reply).decode


class RuntimeReplyError(RuntimeError):
    """The runtime answered a :class:`Failure`."""

    def __init__(self, message: str, is_user_error: bool = False) -> None:
        super().__init__(message)
        self.is_user_error = is_user_error


def ok_reply(data: Any) -> Ok:
    return Ok(data=data)


def error_reply(message: str, is_user_error: bool = False) -> Failure:
    return Failure(error=message, is_user_error=is_user_error)


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


def _unwrap(answer: Reply) -> Any:
    if isinstance(answer, Ok):
        return answer.data
    raise RuntimeReplyError(answer.error or "the runtime answered an error", answer.is_user_error)


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
        self._cmd, self._resp = pair(prefix, "", size, create=create)
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
            answer = _decode_reply(raw)
        except msgspec.DecodeError as exc:
            self._broken = f"main channel: unreadable answer to {op!r}: {exc}"
            raise ChannelError(self._broken) from None
        return _unwrap(answer)

    def close(self) -> None:
        self._broken = self._broken or "closed"
        self._cmd.close()
        self._resp.close()


class _ServerEnd:
    """The runtime end of one channel: commands in, answers out."""

    def __init__(self, prefix: str, suffix: str) -> None:
        self._cmd, self._resp = pair(prefix, suffix, 0, create=False)

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

    def serve(self, handler: Callable[[dict], Reply], reply_timeout: float = 10.0) -> None:
        """Until :meth:`close` or :meth:`finish`. A handler's exception becomes an error
        reply, so the engine always gets an answer and the channel stays in step."""
        for raw in self._incoming():
            try:
                self._resp.send(_encode(_handle(handler, raw)), reply_timeout)
            except ChannelClosed:  # closed while the handler ran
                return
            if self._finishing:
                return


def _handle(handler: Callable[[dict], Reply], raw: bytes) -> Reply:
    try:
        command = _decode(raw)
    except msgspec.DecodeError as exc:
        return error_reply(f"json-error: {exc}", is_user_error=True)
    try:
        read(command, Op)  # the handler reads the rest (and says which field is wrong)
    except BadMessage:
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
        self._cmd, self._resp = pair(prefix, "-side", size, create=create)
        self._max_pending = max_pending
        self._pending: dict[str, Future] = {}
        self.sent = 0  # requests sent so far: whoever reads the runtime's stats asks only after more
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
            self.sent += 1
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
                answer = _decode_reply(raw)
            except msgspec.DecodeError:
                continue  # an answer nobody can claim; its request times out
            with self._lock:
                fut = self._pending.pop(answer.rid, None) if isinstance(answer.rid, str) else None
            if fut is None:  # timed out already, or never ours
                continue
            try:
                _settle(fut, _unwrap(answer))
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

    def serve(self, handler: Callable[[dict, Callable[[Reply], None]], None],
              reply_timeout: float = 10.0) -> None:
        for raw in self._incoming():
            try:
                request = _decode(raw)
                rid = read(request, Addressed).rid
            except (msgspec.DecodeError, BadMessage):
                continue  # no $rid to answer to; the engine's request times out
            reply = self._replier(rid, reply_timeout)
            try:
                handler(request, reply)
            except Exception as exc:  # answered; the channel keeps serving
                reply(error_reply(f"{type(exc).__name__}: {exc}"))

    def _replier(self, rid: Any, timeout: float) -> Callable[[Reply], None]:
        sent = threading.Event()

        def reply(answer: Reply) -> None:
            if sent.is_set():
                return
            sent.set()
            with self._send_lock:
                try:
                    self._resp.send(_encode(msgspec.structs.replace(answer, rid=rid)), timeout)
                except ChannelClosed:
                    pass
        return reply

"""The token stream from engine replicas to an ingress replica: one TCP connection per (ingress
replica, engine replica), one frame per engine step carrying every stream's new events.

Streaming each request's events as Ray objects cost a Ray call per streamed batch and per hop;
on a fast engine that, not the model, bounded throughput
(``docs/results/benchmarks-2026-12-07.md``, "The engine channel"). Ray keeps what it is good at:
the ingress starts each generation with one Serve call (routing, the replicas' queue bounds,
back-pressure and replica-death errors are Serve's, as before), passing its
:class:`ChannelAddress`; the engine replica writes the generation's events to that address
instead of returning them, and the call returns when the stream is over.

Wire format: each frame is a 4-byte big-endian length, then msgpack. The engine replica's first
frame is a :class:`Hello` with the ingress's secret; then :class:`Frame` s. The ingress answers
only with :class:`Withdrawn` (parts came for streams it no longer reads: their generations are
aborted, even if the Serve call's cancellation got lost) and by closing the connection (it
died: every generation sent over it is aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator

import msgspec

from contract import Event

__all__ = ["ChannelAddress", "ChannelLost", "ChannelReceiver", "ChannelSender",
           "ChannelUnreachable", "Inbox"]

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 << 20  # a prompt's logprobs with many alternatives fit many times over
_LENGTH = 4
_CONNECT_TIMEOUT_S = 5.0
_END_GRACE_S = 5.0  # how long a finished call's last frame may trail it (another path)
_STALL_CHECK_S = 1.0
_BACKLOG_EVENTS = 4096  # per connection, not yet written: beyond, its streams wait


class ChannelAddress(msgspec.Struct, frozen=True):
    """Where an ingress replica receives streams; ``key`` names one stream there."""

    host: str
    port: int
    secret: str
    key: int = 0


class Hello(msgspec.Struct, array_like=True):
    secret: str


class StreamPart(msgspec.Struct, array_like=True):
    """One stream's events of one step; ``end``: the stream is over (nothing follows)."""

    key: int
    events: list[Event]
    end: bool = False


class Frame(msgspec.Struct, array_like=True):
    parts: list[StreamPart]


class Withdrawn(msgspec.Struct, array_like=True):
    """Streams the ingress no longer reads (from the ingress to the engine replica)."""

    keys: list[int]


class ChannelLost(Exception):
    """The stream's connection closed, or its call finished without its last frame."""


class ChannelUnreachable(Exception):
    """The engine replica could not connect to the ingress's address (a firewall between
    nodes, say): the ingress then streams over Ray instead."""


_encoder = msgspec.msgpack.Encoder()
_hello_decoder = msgspec.msgpack.Decoder(Hello)
_frame_decoder = msgspec.msgpack.Decoder(Frame)
_withdrawn_decoder = msgspec.msgpack.Decoder(Withdrawn)


def _framed(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return len(body).to_bytes(_LENGTH, "big") + body


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    size = int.from_bytes(await reader.readexactly(_LENGTH), "big")
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes over the bound")
    return await reader.readexactly(size)


# --- the ingress's end ---------------------------------------------------------------------

class Inbox:
    """One stream's events as they arrive; iterate it for batches (lists) of events."""

    def __init__(self, address: ChannelAddress, receiver: ChannelReceiver,
                 stall_timeout_s: float | None = None):
        self.address = address
        self._receiver = receiver
        self.stall_timeout_s = stall_timeout_s
        self.arrived_at = time.monotonic()
        self._events: list[Event] = []
        self._ended = False
        self._failure: BaseException | None = None
        self._arrived = asyncio.Event()
        self.connection: object | None = None  # the connection its first part came on

    def put(self, part: StreamPart, connection: object) -> None:
        self.connection = connection
        self.arrived_at = time.monotonic()
        self._events.extend(part.events)
        self._ended = self._ended or part.end
        self._arrived.set()

    def fail(self, exc: BaseException) -> None:
        if not self._ended and self._failure is None:
            self._failure = exc
            self._arrived.set()

    def call_finished(self, call: asyncio.Future) -> None:
        """The engine call returned or failed: a failure ends the stream now; a return means
        the last frame is on its way (a different path than the call's answer)."""
        if call.cancelled():
            return
        exc = call.exception()
        if exc is not None:
            self.fail(exc)
        elif not self._ended:
            loop = asyncio.get_running_loop()
            loop.call_later(_END_GRACE_S, self.fail,
                            ChannelLost("the engine call ended without its last frame"))

    def close(self) -> None:
        self._receiver.forget(self.address.key)

    def __aiter__(self) -> AsyncIterator[list[Event]]:
        return self._batches()

    async def _batches(self) -> AsyncIterator[list[Event]]:
        while True:
            if not self._events and not self._ended and self._failure is None:
                self._arrived.clear()
                await self._arrived.wait()
            if self._events:
                batch, self._events = self._events, []
                yield batch
            elif self._ended:
                return
            elif self._failure is not None:
                raise self._failure


class ChannelReceiver:
    """An ingress replica's end: a TCP server on ``host`` that engine replicas connect to."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.secret = secrets.token_hex(16)
        self._inboxes: dict[int, Inbox] = {}
        self._keys = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._starting: asyncio.Future | None = None
        self._watchdog: asyncio.Task | None = None
        self.port = 0

    async def start(self) -> None:
        if self._starting is None:  # one start, however many requests ask at once
            self._starting = asyncio.ensure_future(
                asyncio.start_server(self._serve, self.host, 0, limit=1 << 20))
        self._server = await asyncio.shield(self._starting)
        self.port = self._server.sockets[0].getsockname()[1]

    async def open(self, stall_timeout_s: float | None = None) -> Inbox:
        """A new stream's inbox (its ``address`` goes to the engine with the request). With
        ``stall_timeout_s``, iterating it raises TimeoutError once nothing came for that long
        (a replica alive but stuck); checked once a second for every stream, not per token."""
        try:
            await self.start()
        except OSError as exc:  # no port to listen on here: the caller streams over Ray
            raise ChannelUnreachable(f"cannot listen on {self.host}: {exc!r}") from None
        key = next(self._keys)
        address = ChannelAddress(self.host, self.port, self.secret, key)
        inbox = self._inboxes[key] = Inbox(address, self, stall_timeout_s)
        if stall_timeout_s is not None and (self._watchdog is None or self._watchdog.done()):
            self._watchdog = asyncio.ensure_future(self._watch_stalls())
        return inbox

    async def _watch_stalls(self) -> None:
        while any(inbox.stall_timeout_s is not None for inbox in self._inboxes.values()):
            await asyncio.sleep(min([_STALL_CHECK_S, *(
                inbox.stall_timeout_s for inbox in self._inboxes.values()
                if inbox.stall_timeout_s is not None)]))
            now = time.monotonic()
            for inbox in list(self._inboxes.values()):
                if inbox.stall_timeout_s is not None and (
                        now - inbox.arrived_at > inbox.stall_timeout_s):
                    inbox.fail(TimeoutError(f"nothing for {inbox.stall_timeout_s:g} s"))

    def forget(self, key: int) -> None:
        self._inboxes.pop(key, None)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for writer in list(self._writers):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = object()
        self._writers.add(writer)
        try:
            hello = _hello_decoder.decode(await asyncio.wait_for(_read_frame(reader),
                                                                 _CONNECT_TIMEOUT_S))
            # as bytes: compare_digest raises TypeError for a str that is not ASCII
            if not hmac.compare_digest(hello.secret.encode(), self.secret.encode()):
                log.warning("channel connection with a wrong secret refused")
                return
            while True:
                frame = _frame_decoder.decode(await _read_frame(reader))
                withdrawn = self._deliver(frame, connection)
                if withdrawn:
                    writer.write(_framed(Withdrawn(withdrawn)))
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the engine replica closed or died: its streams end below
        except (ValueError, msgspec.DecodeError) as exc:
            log.error("channel connection sent a bad frame: %s", exc)
        finally:
            self._writers.discard(writer)
            writer.close()
            for inbox in list(self._inboxes.values()):
                if inbox.connection is connection:
                    inbox.fail(ChannelLost("the engine replica's connection closed"))

    def _deliver(self, frame: Frame, connection: object) -> list[int]:
        """Hands each part to its inbox; the keys of parts nobody reads any more."""
        withdrawn = []
        for part in frame.parts:
            inbox = self._inboxes.get(part.key)
            if inbox is not None:
                inbox.put(part, connection)
            elif not part.end:
                withdrawn.append(part.key)
        return withdrawn


# --- the engine's end ----------------------------------------------------------------------

class _Connection:
    """One engine replica's connection to one ingress replica: parts of the streams sent
    since the last frame, written as one frame when the loop next gets to the writer."""

    def __init__(self, writer: asyncio.StreamWriter, reader: asyncio.StreamReader):
        self._writer = writer
        self._parts: dict[int, StreamPart] = {}
        self.pending = 0  # events not yet in the socket's buffer
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()  # everything sent is in the socket's buffer
        self._idle.set()
        self.tasks: dict[int, asyncio.Task] = {}  # generations streaming over it, by key
        self.closed = False
        self._workers = [asyncio.ensure_future(self._write()),
                         asyncio.ensure_future(self._watch(reader))]

    def send(self, key: int, event: Event | None = None, *, end: bool = False) -> None:
        """``event`` (if any) goes into stream ``key``'s part of the next frame; ``end`` ends
        the stream there."""
        if self.closed:
            raise ChannelLost("the connection to the ingress closed")
        part = self._parts.get(key)
        if part is None:
            part = self._parts[key] = StreamPart(key, [])
        if event is not None:
            part.events.append(event)
            self.pending += 1
        part.end = part.end or end
        self._idle.clear()
        self._ready.set()

    async def flushed(self) -> None:
        """Until everything sent so far is in the socket's buffer."""
        await self._idle.wait()
        if self.closed:
            raise ChannelLost("the connection to the ingress closed")

    async def _write(self) -> None:
        try:
            while True:
                await self._ready.wait()
                # One more turn: the other streams woken by the same engine step add theirs.
                await asyncio.sleep(0)
                self._ready.clear()
                parts, self._parts, self.pending = list(self._parts.values()), {}, 0
                self._writer.write(_framed(Frame(parts)))
                await self._writer.drain()  # back-pressure: a slow ingress slows its streams
                if not self._parts:
                    self._idle.set()
        except (ConnectionError, RuntimeError) as exc:
            log.warning("channel to the ingress failed: %r", exc)
            self.close()

    async def _watch(self, reader: asyncio.StreamReader) -> None:
        """Aborts the generations the ingress withdraws; all of them when it is gone."""
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError,
                                 msgspec.DecodeError):
            while True:
                for key in _withdrawn_decoder.decode(await _read_frame(reader)).keys:
                    task = self.tasks.get(key)
                    if task is not None:
                        task.cancel()
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._idle.set()  # wakes the waiting streams, which then see ``closed``
        for worker in self._workers:
            if worker is not asyncio.current_task():
                worker.cancel()
        self._writer.close()
        for task in list(self.tasks.values()):  # nobody reads their streams: abort them
            task.cancel()


class ChannelSender:
    """An engine replica's end: a connection per ingress address, opened on first use."""

    def __init__(self):
        self._connections: dict[tuple[str, int, str], _Connection] = {}
        self._opening: dict[tuple[str, int, str], asyncio.Future] = {}

    async def connection(self, address: ChannelAddress) -> _Connection:
        where = (address.host, address.port, address.secret)
        existing = self._connections.get(where)
        if existing is not None and not existing.closed:
            return existing
        if where not in self._opening:
            self._opening[where] = asyncio.ensure_future(self._open(address))
        try:
            connection = await asyncio.shield(self._opening[where])
        finally:
            self._opening.pop(where, None)
        # a new connection is rare: the time to forget those of ingress replicas gone since
        self._connections = {k: c for k, c in self._connections.items() if not c.closed}
        self._connections[where] = connection
        return connection

    async def _open(self, address: ChannelAddress) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(address.host, address.port), _CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            raise ChannelUnreachable(f"{address.host}:{address.port}: {exc!r}") from None
        writer.write(_framed(Hello(address.secret)))
        return _Connection(writer, reader)

    async def stream(self, address: ChannelAddress, events: AsyncIterator[Event]) -> int:
        """Send ``events`` as stream ``address.key``; the number of events sent. Cancelled
        when the ingress's connection closes (which closes ``events``: the engine aborts)."""
        connection = await self.connection(address)
        task = asyncio.current_task()
        connection.tasks[address.key] = task
        sent = 0
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    connection.send(address.key, event)
                    sent += 1
                    if connection.pending >= _BACKLOG_EVENTS:  # a slow ingress: wait for it
                        await connection.flushed()
            connection.send(address.key, end=True)
            await connection.flushed()
        finally:
            connection.tasks.pop(address.key, None)
        return sent

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()

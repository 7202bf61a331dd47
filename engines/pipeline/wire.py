"""The stage channel: micro-batches go origin → stage 0 → … → last stage → origin over ZeroMQ
PUSH/PULL sockets (one PULL per stage, one back at the origin), each stage forwarding its output
straight to the next. Ray places the stages, checks them and respawns them; it carries no hop
(docs/protocols/pipeline.md, "The stage channel").

Why not Ray calls: each chained actor call woke the caller's core worker on the way out and
back, and a chained ObjectRef returns through its owner (the origin) between stages, so one
sequence paid ~15 ms a token over two stages on the 2-core box; sockets between the stages
cost about half (docs/results/benchmarks-2026-12-07.md, "Pipeline hops").

A frame is ``[secret, header]`` or, for a hop, ``[secret, header, hidden bytes, positions
bytes]``; the header is msgpack of one of the typed messages below. The pipe's secret comes
first and is compared before anything is decoded: a frame without it is dropped and logged.
Frames travel in order, so a :class:`Free` sent after a sequence's hop frees that sequence's
cache only after the hop ran, at every stage in turn.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Literal

import msgspec

from engines.pipeline.stage import CacheMismatch, Hop, StageCore

__all__ = ["OriginWire", "StageFailed", "StageLost", "StageServer"]

log = logging.getLogger(__name__)

# The largest message part a stage or the origin takes in: a micro-batch of max_batch_tokens
# activations of a large model is tens of MB; past this a sender is not one of the pipe's.
MAX_PART_BYTES = 1 << 30


class StageFailed(RuntimeError):
    """A stage's forward raised (its message names the error's type): restart path."""


class StageLost(RuntimeError):
    """A stage process is gone (its vigil ended) or is being replaced: everything in flight
    through it is lost."""


class HopHeader(msgspec.Struct, tag="hop", frozen=True):
    """A :class:`Hop` without its tensors (the frames after the header)."""

    step: int
    seq_ids: tuple[str, ...]
    lengths: tuple[int, ...]
    dtype: str  # torch dtype name of ``hidden``
    shape: tuple[int, ...]
    check: bool  # stages verify the digest and sign what they send on
    digest: bytes | None = None
    dropped: dict[str, str] = {}


class Free(msgspec.Struct, tag="free", frozen=True):
    """Drop ``seq_id``'s cache here and pass this on."""

    seq_id: str


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """Micro-batch ``step`` failed at a stage; the rest of the pipe passes this on."""

    step: int
    kind: Literal["cache_mismatch", "error"]
    message: str


Message = HopHeader | Free | Failed
_DTYPES = frozenset({"float32", "bfloat16", "float16"})  # what a stage computes in
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Message).decode


def hop_frames(hop: Hop, secret: str, check: bool) -> list[Any]:
    """``hop`` as frames: its tensors as raw bytes in host memory (no pickling)."""
    import torch

    hidden = hop.hidden.detach().cpu().contiguous()
    header = HopHeader(hop.step, hop.seq_ids, hop.lengths,
                       str(hidden.dtype).removeprefix("torch."), tuple(hidden.shape), check,
                       hop.digest, hop.dropped)
    positions = hop.positions.to(torch.int64).contiguous()
    return [secret.encode(), _encode(header), hidden.view(torch.uint8).numpy(),
            positions.numpy()]


def message_frames(message: Free | Failed, secret: str) -> list[bytes]:
    return [secret.encode(), _encode(message)]


def _tensor(buffer: bytes, dtype: Any, shape: tuple[int, ...]):
    import torch

    count = math.prod(shape)
    if len(buffer) != count * dtype.itemsize:
        raise ValueError(f"{len(buffer)} bytes for {count} {dtype} values")
    if count == 0:  # every sequence dropped on the way: frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(buffer), dtype=torch.uint8)  # writable: torch asks for it
    return raw.view(dtype).reshape(shape)


def _checked(header: HopHeader, frames: list[bytes]) -> Hop:
    """The hop ``header`` describes, its sizes held to each other (ValueError otherwise)."""
    import torch

    tokens = sum(header.lengths)
    if (len(frames) != 4 or header.dtype not in _DTYPES or len(header.shape) != 3
            or header.shape[:2] != (1, tokens) or len(header.seq_ids) != len(header.lengths)
            or min(header.lengths, default=1) < 1):
        raise ValueError(f"{len(frames)} frames, dtype {header.dtype!r}, shape {header.shape} "
                         f"for {tokens} tokens of {len(header.seq_ids)} sequences")
    hidden = _tensor(frames[2], getattr(torch, header.dtype), header.shape)
    positions = _tensor(frames[3], torch.int64, (tokens,))
    return Hop(hidden, positions, header.seq_ids, header.lengths, header.step, header.digest,
               dict(header.dropped))


def read_frames(frames: list[bytes], secret: str) -> tuple[Message, Hop | None] | None:
    """The message in ``frames`` (and, for a hop, the Hop); None when they are not this pipe's
    or do not make a whole message."""
    if len(frames) < 2 or not hmac.compare_digest(bytes(frames[0]), secret.encode()):
        log.warning("dropped a frame without this pipe's secret")
        return None
    try:
        message = _decode(frames[1])
        return message, _checked(message, frames) if isinstance(message, HopHeader) else None
    except (msgspec.DecodeError, ValueError, RuntimeError) as exc:
        log.warning("dropped a malformed stage message: %s", exc)
        return None


def _context():
    import zmq

    return zmq.Context.instance()


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _socket(kind: int, ipv6: bool) -> Any:
    import zmq

    socket = _context().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IPV6, int(ipv6))
    return socket


class _Sender:
    """A PUSH socket to an address that can change (a respawned peer): the new address is
    taken by the next send, on the one thread that sends (ZeroMQ sockets are not thread-safe);
    what was queued for the old peer is discarded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted: str | None = None
        self._address: str | None = None
        self._socket: Any = None

    def connect(self, address: str) -> None:
        with self._lock:
            self._wanted = address

    def send(self, frames: list[Any]) -> bool:
        """Queue ``frames`` without blocking; False when there is nowhere to send them."""
        import zmq

        with self._lock:
            wanted = self._wanted
        if wanted is None:
            return False
        if wanted != self._address:
            self.close()
            self._socket = _socket(zmq.PUSH, ipv6=wanted.startswith("tcp://["))
            self._socket.connect(wanted)
            self._address = wanted
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the peer's queue is full or it never came up: the origin retries
            return False
        return True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket, self._address = None, None


def _bind(host: str) -> tuple[Any, str]:
    import zmq

    socket = _socket(zmq.PULL, ipv6=":" in host)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_PART_BYTES)
    port = socket.bind_to_random_port(_endpoint(host, "").removesuffix(":"))
    return socket, _endpoint(host, port)


def _serve_forever(name: str, receive: Callable[[], None]) -> threading.Thread:
    """``receive`` in a loop on a daemon thread, until its context is closed."""
    import zmq

    def loop() -> None:
        while True:
            try:
                receive()
            except zmq.ContextTerminated:
                return
            except Exception:  # one bad frame must not stop the pipe
                log.exception("%s: a frame failed", name)

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


class StageServer:
    """A stage's end of the channel: pulls frames, runs its :class:`StageCore` over each hop and
    pushes the result to the next address (the next stage, or the origin for the last one).
    One thread, so hops run in the order they were sent."""

    def __init__(self, core: StageCore, secret: str, host: str):
        self.core, self.secret = core, secret
        self._pull, self.address = _bind(host)
        self._next = _Sender()
        self.busy_since: float | None = None  # time.monotonic() of the hop running now
        _serve_forever(f"stage-{core.start}-{core.end}", self._receive_one)

    def connect(self, address: str) -> None:
        """Send on to ``address`` from the next frame on."""
        self._next.connect(address)

    def stuck_s(self) -> float:
        """How long the hop running now has run (0 when idle): a hung stage shows here."""
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _receive_one(self) -> None:
        frames = self._pull.recv_multipart()
        read = read_frames(frames, self.secret)
        if read is None:
            return
        message, hop = read
        if isinstance(message, Free):
            self.core.free(message.seq_id)
        elif hop is not None:
            frames = self._forward(hop, message.check)
        if not self._next.send(frames):  # the origin's step timeout restarts what it carried
            log.warning("stage %d-%d could not send on (no next stage yet, or its queue is "
                        "full)", self.core.start, self.core.end)

    def _forward(self, hop: Hop, check: bool) -> list[Any]:
        self.busy_since = time.monotonic()
        try:
            return hop_frames(self.core.forward(hop, check), self.secret, check)
        except CacheMismatch as exc:
            return message_frames(Failed(hop.step, "cache_mismatch", str(exc)), self.secret)
        except Exception as exc:
            log.exception("stage %d-%d failed on micro-batch %d", self.core.start,
                          self.core.end, hop.step)
            return message_frames(Failed(hop.step, "error", type(exc).__name__), self.secret)
        finally:
            self.busy_since = None


class OriginWire:
    """The origin's end: a PUSH to the first stage (used from the origin's one thread) and a
    PULL for what the last stage sends back, read by a thread of its own that completes each
    micro-batch's future by its ``step``. While the pipe is broken (:meth:`fail_all` until
    :meth:`mend`) a submission fails at once."""

    def __init__(self, secret: str, host: str):
        self.secret = secret
        self._pull, self.address = _bind(host)
        self._first = _Sender()
        self._lock = threading.Lock()
        self._waiting: dict[int, Future] = {}
        self._broken: BaseException | None = None
        self._thread = _serve_forever("pipeline-origin-wire", self._receive_one)

    def connect(self, address: str) -> None:
        """The first stage is at ``address`` (again, after a respawn)."""
        self._first.connect(address)

    def submit(self, hop: Hop, check: bool) -> Future:
        """Send ``hop`` into the pipe; its result (or the error a stage sent) completes the future."""
        future: Future = Future()
        frames = hop_frames(hop, self.secret, check)
        with self._lock:
            broken = self._broken
            if broken is None:
                self._waiting[hop.step] = future
        if broken is not None:
            future.set_exception(StageLost(str(broken)))
            return future
        try:
            sent = self._first.send(frames)
        except Exception as exc:
            self.forget(hop.step)
            future.set_exception(StageLost(f"sending to the first stage failed: {exc!r}"))
            return future
        if not sent:
            self.forget(hop.step)
            future.set_exception(StageLost("the first stage is not reachable"))
        return future

    def free(self, seq_id: str) -> None:
        """Best effort: a free that cannot be sent leaves the cache to the stages' TTL sweep."""
        self._first.send(message_frames(Free(seq_id), self.secret))

    def forget(self, step: int) -> None:
        """Nobody waits for ``step`` any more (it timed out, or its job moved on)."""
        with self._lock:
            self._waiting.pop(step, None)

    def fail_all(self, error: BaseException) -> None:
        """Every micro-batch in flight fails with ``error`` (a stage on their way is gone), and
        so does every submission until :meth:`mend`."""
        with self._lock:
            waiting, self._waiting = self._waiting, {}
            self._broken = error
        for future in waiting.values():
            _settle(future, error=error)

    def mend(self) -> None:
        """The pipe is whole again (its stages recovered)."""
        with self._lock:
            self._broken = None

    def broken(self) -> BaseException | None:
        with self._lock:
            return self._broken

    def in_flight(self) -> int:
        with self._lock:
            return len(self._waiting)

    def _receive_one(self) -> None:
        read = read_frames(self._pull.recv_multipart(), self.secret)
        if read is None:
            return
        message, hop = read
        if isinstance(message, Free):
            return  # it has been through every stage: nothing more to do
        with self._lock:
            future = self._waiting.pop(message.step, None)
        if future is None:
            return  # void: its waiter gave up (a timeout, a restart)
        if hop is not None:
            _settle(future, result=hop)
        elif message.kind == "cache_mismatch":
            _settle(future, error=CacheMismatch(message.message))
        else:
            _settle(future, error=StageFailed(f"a stage failed: {message.message}"))


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless its waiter already gave up (cancelled it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass

"""One LMTP websocket connection: many interleaved streams, keyed by the client's stream ids.

Stream ids are scoped to the connection (two clients may both use ``1``). Each GENERATE/SCORE
runs as its own task; a single writer drains everything queued into as few frames as possible
(items of different streams may share a frame; order within a stream is kept). Closing the
connection cancels every task, which aborts the engine requests.

Every buffer has a bound (:class:`LMTPLimits`): concurrent streams (the excess is refused with a
TOKEN error on that stream), frame size (an error on the frame's stream, the connection stays
open), and the outbox — a client that reads slowly stalls its streams, and then the reading of
its frames, instead of growing the replica's memory. A connection with no stream and no frame
for ``idle_timeout_s`` is closed. Errors carry no exception text: details go to the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from contract import EngineUnavailable
from contract.client import EngineClient
from protocols.lmtp.encode import generate_items, score_items
from protocols.lmtp.frames import FrameError, format_frame, parse_frame, salvage_stream_id
from protocols.lmtp.translate import LMTPError, generate_request, score_request

__all__ = ["LMTPLimits", "LMTPSession"]

log = logging.getLogger(__name__)

_MAX_ITEMS_PER_FRAME = 512  # keeps frames far below the 4 MiB clients accept
_SALVAGE_CHARS = 65536  # how much of an oversize frame is searched for its stream id
Resolver = Callable[[str | None], tuple[str, EngineClient]]
ModelInfoFn = Callable[[str], Any]


def _valid_stream_id(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


class LMTPLimits(msgspec.Struct, frozen=True, kw_only=True):
    """LMTP's bounds per websocket connection (its ``ProtocolSpec.options``; each field's
    ``name`` is its key in the gateway's configuration, docs/configuration.md)."""

    max_streams: int = msgspec.field(default=128, name="lmtp_max_streams")
    max_frame_bytes: int = msgspec.field(default=4 * 1024 * 1024, name="lmtp_max_frame_bytes")
    outbox_items: int = msgspec.field(default=4096, name="lmtp_outbox_items")
    idle_timeout_s: float | None = msgspec.field(default=900.0, name="lmtp_idle_timeout_s")


class LMTPSession:
    def __init__(self, websocket: WebSocket, resolve: Resolver, model_info: ModelInfoFn,
                 limits: LMTPLimits | None = None):
        self.websocket = websocket
        self.resolve = resolve
        self.model_info = model_info
        self.limits = limits or LMTPLimits()
        self.outbox: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue(
            self.limits.outbox_items)
        self.streams: dict[Any, asyncio.Task] = {}
        self.connection_id = uuid.uuid4().hex[:12]

    async def run(self) -> None:
        await self.websocket.accept()
        writer = asyncio.create_task(self._write_loop())
        try:
            while True:
                idle = None if self.streams else self.limits.idle_timeout_s
                try:
                    async with asyncio.timeout(idle):
                        message = await self.websocket.receive()
                except TimeoutError:
                    await self.websocket.close(1001, "idle")
                    break
                if message["type"] == "websocket.disconnect":
                    break
                text = message.get("text")
                if text is not None:  # binary frames are not part of LMTP; ignore them
                    try:
                        await self._dispatch(text)
                    except Exception:  # one bad frame must not end the connection
                        log.exception("LMTP frame handling failed on %s", self.connection_id)
                        await self._send("MSG", {"stream_id": None, "error": "internal error"})
        except WebSocketDisconnect:
            pass
        finally:
            tasks = [*self.streams.values(), writer]
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # --- inbound ------------------------------------------------------------------------

    async def _send(self, kind: str, item: dict[str, Any]) -> None:
        await self.outbox.put((kind, item))  # waits while the client is behind

    async def _dispatch(self, text: str) -> None:
        try:
            command, payload = parse_frame(self._within_limit(text))
        except FrameError as exc:
            if exc.stream_id is not None:
                await self._send("TOKEN", {"stream_id": exc.stream_id, "error": str(exc)})
            else:
                await self._send("MSG", {"stream_id": None, "error": str(exc)})
            return
        stream_id = payload.get("stream_id")
        if not _valid_stream_id(stream_id):
            await self._send("MSG", {"stream_id": None, "error":
                                     f"{command}: 'stream_id' must be an integer or string"})
            return
        if command in ("GENERATE", "SCORE"):
            await self._start_stream(command, stream_id, payload)
        elif command == "MODEL_INFO":
            task = asyncio.create_task(self._model_info(stream_id, payload))
            self.streams[("info", stream_id, id(task))] = task
            task.add_done_callback(lambda t: self.streams.pop(("info", stream_id, id(t)), None))
        else:  # on TOKEN: LMQL listens for a stream's errors only there
            await self._send("TOKEN", {"stream_id": stream_id,
                                       "error": f"Unknown command: {command[:64]}"})

    def _within_limit(self, text: str) -> str:
        limit = self.limits.max_frame_bytes
        # Characters are a lower bound of UTF-8 bytes: encode only when it could matter.
        if len(text) > limit or (len(text) * 4 > limit and len(text.encode()) > limit):
            body = text[:_SALVAGE_CHARS].partition(" ")[2]
            raise FrameError(f"frame exceeds the limit of {limit} bytes", salvage_stream_id(body))
        return text

    async def _start_stream(self, command: str, stream_id: Any, payload: dict[str, Any]) -> None:
        if stream_id in self.streams:
            await self._send("TOKEN", {"stream_id": stream_id,
                                       "error": f"stream_id {stream_id!r} is already in use"})
            return
        if len(self.streams) >= self.limits.max_streams:
            await self._send("TOKEN", {"stream_id": stream_id, "error": (
                f"too many concurrent streams on this connection (at most "
                f"{self.limits.max_streams}); retry when one has finished")})
            return
        task = asyncio.create_task(self._stream(command, stream_id, payload))
        self.streams[stream_id] = task
        task.add_done_callback(lambda _: self.streams.pop(stream_id, None))

    async def _stream(self, command: str, stream_id: Any, payload: dict[str, Any]) -> None:
        try:
            events, items = self._items(command, stream_id, payload)
            # Closed now, not when collected: a closed connection aborts the engine request at
            # once even while this stream waits for room in the outbox.
            async with aclosing(events), aclosing(items):
                async for item in items:
                    await self._send("TOKEN", item)
        except (LMTPError, EngineUnavailable) as exc:  # messages meant for the client
            await self._send("TOKEN", {"stream_id": stream_id, "error": str(exc)})
        except asyncio.CancelledError:
            raise
        except Exception:  # never strand the client's iterator for this stream
            log.exception("LMTP stream %r on %s failed", stream_id, self.connection_id)
            await self._send("TOKEN", {"stream_id": stream_id, "error": "internal error"})

    def _items(self, command: str, stream_id: Any,
               payload: dict[str, Any]) -> tuple[AsyncIterator, AsyncIterator]:
        """The engine's events and the LMTP items made of them."""
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise LMTPError("missing field 'model'")
        try:
            name, engine = self.resolve(model)
        except LookupError:
            raise LMTPError(f"model '{model}' is not served here") from None
        payload = {**payload, "model": name}
        request_id = f"lmtp-{self.connection_id}-{stream_id}-{uuid.uuid4().hex[:8]}"
        if command == "GENERATE":
            events = engine.generate(generate_request(payload, request_id))
            return events, generate_items(events, stream_id)
        request, start, count = score_request(payload, request_id)
        events = engine.generate(request)
        return events, score_items(events, stream_id, start, count)

    async def _model_info(self, stream_id: Any, payload: dict[str, Any]) -> None:
        try:
            name, _ = self.resolve(payload.get("model"))
            info = await self.model_info(name)
            reply = {"model": name, "engine": info.engine, "root": info.root,
                     "max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
                     "eos_token_id": info.eos_token_id}
            await self._send("MSG", {"stream_id": stream_id, "model_info": reply})
        except LookupError:
            await self._send("MSG", {"stream_id": stream_id,
                                     "error": f"model '{payload.get('model')}' is not served here"})
        except EngineUnavailable as exc:
            await self._send("MSG", {"stream_id": stream_id, "error": str(exc)})
        except Exception:
            log.exception("LMTP model info on %s failed", self.connection_id)
            await self._send("MSG", {"stream_id": stream_id, "error": "model info failed"})

    # --- outbound -----------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            batch = [await self.outbox.get()]
            while not self.outbox.empty() and len(batch) < _MAX_ITEMS_PER_FRAME:
                batch.append(self.outbox.get_nowait())
            for kind, items in _group(batch):
                await self.websocket.send_text(format_frame(kind, items))


def _group(batch: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Consecutive items of the same message type share one frame (order is preserved)."""
    groups: list[tuple[str, list[dict[str, Any]]]] = []
    for kind, item in batch:
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(item)
        else:
            groups.append((kind, [item]))
    return groups

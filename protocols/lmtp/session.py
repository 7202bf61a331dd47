"""One LMTP websocket connection: many interleaved streams, keyed by the client's stream ids.

Stream ids are scoped to the connection (two clients may both use ``1``). Each GENERATE/SCORE
runs as its own task; a single writer drains everything queued into as few frames as possible
(items of different streams may share a frame; order within a stream is kept). Closing the
connection cancels every task, which aborts the engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from protocols.internal import EngineClient
from protocols.lmtp.encode import generate_items, score_items
from protocols.lmtp.frames import FrameError, format_frame, parse_frame
from protocols.lmtp.translate import LMTPError, generate_request, score_request

__all__ = ["LMTPSession"]

log = logging.getLogger(__name__)

_MAX_ITEMS_PER_FRAME = 512  # keeps frames far below the 4 MiB clients accept
Resolver = Callable[[str | None], tuple[str, EngineClient]]
ModelInfoFn = Callable[[str], Any]


def _valid_stream_id(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


class LMTPSession:
    def __init__(self, websocket: WebSocket, resolve: Resolver, model_info: ModelInfoFn):
        self.websocket = websocket
        self.resolve = resolve
        self.model_info = model_info
        self.outbox: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self.streams: dict[Any, asyncio.Task] = {}
        self.connection_id = uuid.uuid4().hex[:12]

    async def run(self) -> None:
        await self.websocket.accept()
        writer = asyncio.create_task(self._write_loop())
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                text = message.get("text")
                if text is not None:  # binary frames are not part of LMTP; ignore them
                    try:
                        self._dispatch(text)
                    except Exception as exc:  # one bad frame must not end the connection
                        log.exception("LMTP frame handling failed")
                        self._send("MSG", {"stream_id": None, "error": f"internal error: {exc}"})
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

    def _send(self, kind: str, item: dict[str, Any]) -> None:
        self.outbox.put_nowait((kind, item))

    def _dispatch(self, text: str) -> None:
        try:
            command, payload = parse_frame(text)
        except FrameError as exc:
            if exc.stream_id is not None:
                self._send("TOKEN", {"stream_id": exc.stream_id, "error": str(exc)})
            else:
                self._send("MSG", {"stream_id": None, "error": str(exc)})
            return
        stream_id = payload.get("stream_id")
        if not _valid_stream_id(stream_id):
            self._send("MSG", {"stream_id": None,
                               "error": f"{command}: 'stream_id' must be an integer or string"})
            return
        if command in ("GENERATE", "SCORE"):
            self._start_stream(command, stream_id, payload)
        elif command == "MODEL_INFO":
            task = asyncio.create_task(self._model_info(stream_id, payload))
            self.streams[("info", stream_id, id(task))] = task
            task.add_done_callback(lambda t: self.streams.pop(("info", stream_id, id(t)), None))
        else:
            self._send("MSG", {"stream_id": stream_id, "error": f"Unknown command: {command}"})

    def _start_stream(self, command: str, stream_id: Any, payload: dict[str, Any]) -> None:
        if stream_id in self.streams:
            self._send("TOKEN", {"stream_id": stream_id,
                                 "error": f"stream_id {stream_id!r} is already in use"})
            return
        task = asyncio.create_task(self._stream(command, stream_id, payload))
        self.streams[stream_id] = task
        task.add_done_callback(lambda _: self.streams.pop(stream_id, None))

    async def _stream(self, command: str, stream_id: Any, payload: dict[str, Any]) -> None:
        try:
            items = self._items(command, stream_id, payload)
            async for item in items:
                self._send("TOKEN", item)
        except LMTPError as exc:
            self._send("TOKEN", {"stream_id": stream_id, "error": str(exc)})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never strand the client's iterator for this stream
            log.exception("LMTP stream %r failed", stream_id)
            self._send("TOKEN", {"stream_id": stream_id, "error": f"internal error: {exc}"})

    def _items(self, command: str, stream_id: Any, payload: dict[str, Any]) -> AsyncIterator:
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
            return generate_items(engine.generate(generate_request(payload, request_id)),
                                  stream_id)
        request, start, count = score_request(payload, request_id)
        return score_items(engine.generate(request), stream_id, start, count)

    async def _model_info(self, stream_id: Any, payload: dict[str, Any]) -> None:
        try:
            name, _ = self.resolve(payload.get("model"))
            info = await self.model_info(name)
            reply = {"model": name, "engine": info.engine, "root": info.root,
                     "max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
                     "eos_token_id": info.eos_token_id}
            self._send("MSG", {"stream_id": stream_id, "model_info": reply})
        except LookupError:
            self._send("MSG", {"stream_id": stream_id,
                               "error": f"model '{payload.get('model')}' is not served here"})
        except Exception as exc:
            self._send("MSG", {"stream_id": stream_id, "error": f"model info failed: {exc}"})

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

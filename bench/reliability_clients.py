"""The reliability bench's clients (``bench/reliability.py``): every protocol's generation path
over HTTP, and LMTP over a websocket, with the prompts whose greedy answers are known."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import websockets

from engines.kit.embedded import EMBEDDED_MODEL_NAME as MODEL

APP = "relbench"
CLIENT_TIMEOUT_S = 60.0  # a request that takes longer is a hang
MAX_TOKENS = 16
LONG_TOKENS = 400
OVERLOAD_ENGINE_ARGS = {"max_num_seqs": 4}
PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "A haiku is a short poem that",
    "The first person to walk on the moon was",
    "Photosynthesis is the process by which",
    "My favourite recipe for pancakes starts with",
]
LONG_PROMPT = "Count from one to one thousand, writing every number in words, one per line:"
TOO_MANY = "too many concurrent streams"


class Failed(Exception):
    """A request that did not produce its answer: ``kind`` is the HTTP status or a label."""

    def __init__(self, kind: int | str, detail: str = "", last: Any = None,
                 retry_after: str | None = None):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.last, self.retry_after = kind, detail, last, retry_after


def http_client(url: str, connections: int = 64) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(CLIENT_TIMEOUT_S, connect=10),
                             limits=httpx.Limits(max_connections=connections,
                                                 max_keepalive_connections=connections))


async def engine_stats(c: httpx.AsyncClient) -> dict[str, int] | None:
    try:
        r = await c.get("/gateway/engines", timeout=5)
        return r.json()[MODEL] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


async def until_idle(c: httpx.AsyncClient, timeout_s: float = 120) -> float | None:
    """Seconds until the engine reports no request in flight (None: not within timeout_s)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        stats = await engine_stats(c)
        if stats is not None and stats["active"] == 0:
            return round(time.monotonic() - started, 3)
        await asyncio.sleep(0.1)
    return None


@dataclass(frozen=True)
class HttpPath:
    """One HTTP generation route: its body, framing, and how to read the generated text."""

    path: str
    framing: str  # "json", "sse" (data: lines) or "jsonl"
    body: Callable[[str, int, bool], dict]  # (prompt, max tokens, ignore EOS) → body
    text: Callable[[list[dict]], str]
    done: Callable[[list[dict]], bool]  # the answer ended properly


def _openai(prompt: str, n: int, long: bool, stream: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "stream": stream, **({"ignore_eos": True} if long else {})}


def _chat(prompt: str, n: int, long: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": n,
            "temperature": 0, **({"ignore_eos": True} if long else {})}


def _textgen(prompt: str, n: int, long: bool, stream: bool | None = None) -> dict:
    body: dict[str, Any] = {"inputs": prompt, "parameters": {
        "do_sample": False, "max_new_tokens": n, **({"ignore_eos": True} if long else {})}}
    return body if stream is None else {**body, "stream": stream}


def _mindie(prompt: str, n: int, long: bool) -> dict:
    return {"text_input": prompt, "parameters": {
        "do_sample": False, "max_new_tokens": n, "details": True,
        **({"ignore_eos": True} if long else {})}}


def _last(objs: list[dict], key: str) -> Any:
    return objs[-1].get(key) if objs else None


HTTP_PATHS: dict[str, HttpPath] = {
    "openai_stream": HttpPath(
        "/v1/completions", "sse", lambda p, n, long: _openai(p, n, long, True),
        lambda objs: "".join(ch["text"] for o in objs for ch in o.get("choices", [])),
        lambda objs: any(ch.get("finish_reason") for o in objs for ch in o.get("choices", []))),
    "openai": HttpPath(
        "/v1/completions", "json", lambda p, n, long: _openai(p, n, long, False),
        lambda objs: objs[0]["choices"][0]["text"], lambda objs: True),
    "chat": HttpPath(
        "/v1/chat/completions", "json", _chat,
        lambda objs: objs[0]["choices"][0]["message"]["content"], lambda objs: True),
    "tgi_stream": HttpPath(
        "/generate_stream", "sse", _textgen, lambda objs: _last(objs, "generated_text") or "",
        lambda objs: _last(objs, "generated_text") is not None),
    "lmi_stream": HttpPath(
        "/invocations", "jsonl", lambda p, n, long: _textgen(p, n, long, True),
        lambda objs: _last(objs, "generated_text") or "",
        lambda objs: _last(objs, "generated_text") is not None),
    "mindie_stream": HttpPath(
        f"/v2/models/{MODEL}/generate_stream", "sse", _mindie,
        lambda objs: "".join(o.get("text_output") or "" for o in objs),
        lambda objs: bool((_last(objs, "details") or {}).get("finish_reason"))),
}


STREAMING = ["openai_stream", "tgi_stream", "lmi_stream", "mindie_stream", "lmtp"]


SOAK_PATHS = [*HTTP_PATHS, "lmtp"]


def _error_of(obj: dict) -> str | None:
    """The error an in-stream object carries, in any protocol's shape."""
    error = obj.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    if error:
        return str(error)
    token = obj.get("token")
    if isinstance(token, dict) and token.get("error_msg"):
        return str(token["error_msg"])  # LMI's stream error line
    return None


async def http_objects(c: httpx.AsyncClient, route: HttpPath, body: dict) -> AsyncIterator[dict]:
    """POST ``body`` and yield the response's JSON objects (one for a plain response). A non-200
    status or an error object raises :class:`Failed`; an answer that did not end properly too."""
    async with c.stream("POST", route.path, json=body) as r:
        if r.status_code != 200:
            raw = await r.aread()
            raise Failed(r.status_code, raw[:300].decode(errors="replace"),
                         retry_after=r.headers.get("retry-after"))
        if route.framing == "json":
            yield json.loads(await r.aread())
            return
        seen: list[dict] = []
        async for line in r.aiter_lines():
            if route.framing == "sse":
                data = line[5:].strip() if line.startswith("data:") else ""
            else:
                data = line.strip()
            if not data or data == "[DONE]":
                continue
            obj = json.loads(data)
            error = _error_of(obj)
            if error is not None:
                raise Failed("stream_error", error, last=obj)
            seen.append(obj)
            yield obj
        if not route.done(seen):
            raise Failed("truncated", f"{len(seen)} objects, no proper end",
                         last=seen[-1] if seen else None)


async def http_text(c: httpx.AsyncClient, name: str, prompt: str, max_tokens: int) -> str:
    route = HTTP_PATHS[name]
    objs = [o async for o in http_objects(c, route, route.body(prompt, max_tokens, False))]
    return route.text(objs)


def ws_connect(url: str):
    return websockets.connect(url.replace("http://", "ws://", 1) + "/lmtp", max_size=2**24,
                              open_timeout=10, close_timeout=2)


def generate_frame(stream_id: int, ids: list[int], max_tokens: int,
                    logit_bias: dict[str, float] | None = None) -> str:
    payload: dict[str, Any] = {"model": MODEL, "prompt": ids, "stream_id": stream_id,
                               "max_tokens": max_tokens, "temperature": 0.0}
    if logit_bias:
        payload["logit_bias"] = logit_bias
    return "GENERATE " + json.dumps(payload)


async def lmtp_items(ws) -> list[dict]:
    """The items of the next frame (``TOKEN [...]`` or ``MSG [...]``)."""
    _, _, body = (await ws.recv()).partition(" ")
    return json.loads(body)


async def lmtp_generate(ws, stream_id: int, ids: list[int], max_tokens: int,
                        logit_bias: dict[str, float] | None = None) -> tuple[list[int], str]:
    """One GENERATE on an otherwise idle connection: (token ids, finish reason)."""
    await ws.send(generate_frame(stream_id, ids, max_tokens, logit_bias))
    tokens: list[int] = []
    while True:
        for item in await lmtp_items(ws):
            if item.get("stream_id") != stream_id:
                continue  # a late item of an earlier stream that timed out
            if item.get("error"):
                raise Failed("stream_error", item["error"], last=item)
            tokens.append(item["token"])
            if item.get("finish_reason"):
                return tokens, item["finish_reason"]

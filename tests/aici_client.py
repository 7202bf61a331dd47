"""A client for AICI's REST API that behaves as AICI's own Python client (``pyaici.rest`` in
microsoft/aici, not on PyPI) does, written from its behaviour: that client's request bodies and
its SSE parsing are the contract ``/v1/run`` must meet.

What it does, as pyaici.rest does: the base URL (default ``$AICI_API_BASE``) may carry the key as
a ``#key=...`` fragment, sent as an ``api-key`` header; ``run`` POSTs ``{controller,
controller_arg, max_tokens, temperature}`` with ``None`` fields removed at every depth
(programs built as pyaici.ast builds them carry many); every non-empty
response line must be ``data: {...}`` or ``data: [DONE]`` (anything else raises); each object's
``usage`` is kept; the first object with ``forks`` must carry ``usage.ff_tokens``; per fork
``index`` the ``text`` and ``logs`` deltas are appended and ``storage`` ``WriteVar`` entries
collected (values hex, decoded at the end); a non-empty ``error`` stops reading; the last
``usage.sampled_tokens`` gives the sampling rate. A non-200 answer raises with its body's
``message`` (JSON) or its text.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from typing import Any

import requests

__all__ = ["AiciClient"]


class AiciClient:
    def __init__(self, base_url: str | None = None):
        url = base_url or os.environ.get("AICI_API_BASE", "http://127.0.0.1:4242/v1/")
        parts = urllib.parse.urlparse(url)
        key = urllib.parse.parse_qs(parts.fragment).get("key", [""])[0] if parts.fragment else ""
        self.prefix = urllib.parse.urlunparse(parts._replace(fragment="", query=""))
        if not self.prefix.endswith("/"):
            self.prefix += "/"
        self.headers = {"api-key": key} if key else {}

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        return requests.request(method, self.prefix + path, headers=self.headers, timeout=300,
                                **kwargs)

    @staticmethod
    def _failure(kind: str, resp: requests.Response) -> RuntimeError:
        text = resp.text
        try:
            decoded = json.loads(text)
            if isinstance(decoded, dict) and "message" in decoded:
                text = decoded["message"]
        except ValueError:
            pass
        return RuntimeError(f"bad response to {kind} {resp.status_code} {resp.reason}: {text}")

    def upload_module(self, data: bytes) -> str:
        resp = self._request("post", "controllers", data=data)
        if resp.status_code != 200:
            raise self._failure("module upload", resp)
        return resp.json()["module_id"]

    def list_tags(self) -> list[dict]:
        resp = self._request("get", "controllers/tags")
        if resp.status_code != 200:
            raise self._failure("module tag", resp)
        return resp.json()["tags"]

    def tag_module(self, module_id: str, tags: list[str]) -> list[dict]:
        resp = self._request("post", "controllers/tags", json={"module_id": module_id,
                                                               "tags": tags})
        if resp.status_code != 200:
            raise self._failure("module tag", resp)
        return resp.json()["tags"]

    def run(self, *, controller: str, controller_arg: Any = "",
            temperature: float | None = None, max_tokens: int | None = 200) -> dict:
        body = {"controller": controller, "controller_arg": controller_arg,
                "max_tokens": max_tokens, "temperature": temperature}
        body = _without_none(body)
        started = time.time()
        resp = self._request("post", "run", json=body, stream=True)
        if resp.status_code != 200:
            raise self._failure("run", resp)
        texts, logs, objects, raw_storage = [""], [""], [], {}
        result: dict[str, Any] = {"request": body, "response": objects, "text": texts,
                                  "logs": logs, "error": None, "usage": {}, "tps": {}}
        for line in resp.iter_lines():
            if result["error"]:
                break
            if not line:
                continue
            decoded = line.decode("utf-8")
            if decoded == "data: [DONE]":
                continue
            if not decoded.startswith("data: {"):
                raise RuntimeError(f"bad response line: {decoded}")
            obj = json.loads(decoded[len("data: "):])
            objects.append(obj)
            if "usage" in obj:
                result["usage"] = obj["usage"]
            if "forks" not in obj:
                continue
            if "prompt" not in result["tps"]:
                elapsed = max(time.time() - started, 1e-9)
                result["tps"]["prompt"] = obj["usage"]["ff_tokens"] / elapsed
            for fork in obj["forks"]:
                index = fork["index"]
                while len(texts) <= index:
                    texts.append("")
                    logs.append("")
                for entry in fork.get("storage", []):
                    var = entry.get("WriteVar")
                    if var:
                        raw_storage[var["name"]] = var["value"]
                if fork.get("error", ""):
                    result["error"] = fork["error"]
                logs[index] += fork["logs"]
                texts[index] += fork["text"]
        elapsed = time.time() - started
        result["tps"]["sampling"] = result["usage"]["sampled_tokens"] / elapsed
        result["storage"] = {name: bytes.fromhex(value).decode("utf-8", errors="ignore")
                             for name, value in raw_storage.items()}
        return result


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value

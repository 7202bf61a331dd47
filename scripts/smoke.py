"""One request per protocol and served model against a running gateway, printed as a table:
`python scripts/smoke.py [URL]` (default http://127.0.0.1:8000). A quick look after
`ray up` + `serve deploy`, not a test: it asserts nothing."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import websockets

PROMPT = "The capital of France is"


def _show(label: str, response: httpx.Response, pick) -> None:
    try:
        body = pick(response.json())
    except (ValueError, KeyError, TypeError, IndexError):
        body = response.text[:120]
    print(f"{label:58} {response.status_code} {json.dumps(body)[:90]}")


async def _lmtp(url: str, model: str, ids: list[int]) -> tuple[str, list[int]]:
    async with websockets.connect(url.replace("http", "ws", 1) + "/lmtp") as ws:
        await ws.send("GENERATE " + json.dumps({"model": model, "prompt": ids, "stream_id": 1,
                                                "max_tokens": 8}))
        tokens: list[int] = []
        while True:
            kind, _, body = (await ws.recv()).partition(" ")
            items = json.loads(body)
            tokens += [i["token"] for i in items if "token" in i]
            if any(i.get("finish_reason") or "error" in i for i in items):
                return kind, tokens


def main(url: str) -> None:
    with httpx.Client(base_url=url, timeout=120) as c:
        models = [m["id"] for m in c.get("/v1/models").json()["data"]]
        _show("GET /v1/models", c.get("/v1/models"), lambda j: [m["id"] for m in j["data"]])
        _show("GET /models (LMI)", c.get("/models"),
              lambda j: [m["modelName"] for m in j["models"]])
        for m in models:
            _show(f"OpenAI /v1/completions {m}", c.post("/v1/completions", json={
                "model": m, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}),
                lambda j: j["choices"][0]["text"])
            _show(f"OpenAI /v1/chat/completions {m}", c.post("/v1/chat/completions", json={
                "model": m, "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 8, "temperature": 0}), lambda j: j["choices"][0]["message"]["content"])
            _show(f"MindIE /v2/models/{m}/generate", c.post(f"/v2/models/{m}/generate", json={
                "text_input": PROMPT, "parameters": {"max_new_tokens": 8}}),
                lambda j: j["text_output"])
            _show(f"LMI /predictions/{m}", c.post(f"/predictions/{m}", json={
                "inputs": PROMPT, "parameters": {"max_new_tokens": 8, "do_sample": False}}),
                lambda j: j["generated_text"])
        _show("TGI /generate (tgi_model: the first model)", c.post("/generate", json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 8}}), lambda j: j["generated_text"])
        for m in models:
            ids = c.post("/tokenize", json={"model": m, "prompt": PROMPT}).json()["tokens"]
            print(f"{'LMTP GENERATE ' + m:58}", asyncio.run(_lmtp(url, m, ids)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000")

"""The ingress request router of a model routed by prefix: HAProxy asks it which of the
model's replicas should serve a request it is about to send to the model's own application
(docs/routing.md).

Ray Serve's HAProxy ingress supports one such router per application (Serve attaches it with
``Application._with_ingress_request_router``, the hook Ray Serve LLM's direct streaming uses):
for each POST to the application, HAProxy's Lua action sends the request's body to the router's
``POST /internal/route``, reads the ``replica_id`` it answers, and forwards the request to that
replica itself; the router never sees the response. Here the router reads the prompt out of the
body (:func:`body_blocks`) and asks the engine deployment's own request router
(``engines.caller.prefix_router``) for a replica without sending anything (``choose_replica`` with
``_reserve=False``), so both ways into a model, HAProxy's and the engine channel's, pick with
one policy.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic_core import from_json
from ray import serve
from ray.serve.handle import DeploymentHandle

from engines.caller.prefix_affinity import chat_text, prefix_blocks
from engines.caller.routing import RouteQuery
from engines.kit.config import ModelConfig

__all__ = ["IngressRouter", "body_blocks", "body_text", "with_ingress_router"]

router_api = FastAPI()


def _content(content: Any) -> str:
    """A message's text as the protocols read it: a string, or the text of its parts (OpenAI's
    text parts, Anthropic's text blocks, the Responses API's input and output text) joined by
    newlines."""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def _chat(body: dict[str, Any]) -> list[tuple[str, str]] | None:
    """A chat body's messages as (role, text): OpenAI chat's ``messages``, Anthropic's ``system``
    and ``messages``, the Responses API's ``instructions`` and ``input`` (a string is one user
    message; its ``developer`` role is ``system``, as the protocol reads it). None: no chat."""
    turns = body.get("messages", body.get("input"))
    system = body.get("system", body.get("instructions"))
    if isinstance(turns, str):
        turns = [{"role": "user", "content": turns}]
    if not isinstance(turns, list):
        return None
    out = [("system", _content(system))] if system else []
    for turn in turns:
        if isinstance(turn, dict) and isinstance(turn.get("role"), str):
            role = "system" if turn["role"] == "developer" else turn["role"]
            out.append((role, _content(turn.get("content"))))
    return out


def body_text(body: dict[str, Any]) -> str:
    """The prompt of a request HAProxy sends to a model's application, as routing reads it
    (``engines.caller.prefix_affinity.prompt_text`` of the internal prompt the protocol makes of it,
    for text; tool calls and results are left out): a chat (``_chat``), a completion's
    ``prompt`` (the first of several), MindIE's ``text_input``, LMI's and TGI's ``inputs``.
    Anything else has no text, and is routed by load."""
    chat = _chat(body)
    if chat is not None:
        return chat_text(chat)
    prompt = body.get("prompt", body.get("text_input", body.get("inputs")))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return "".join(f"{t}," for t in prompt)
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


def body_blocks(body: bytes) -> tuple[int, ...]:
    """The prompt keys of a raw request body, which HAProxy may have cut at its buffer's end:
    read as far as it goes (a cut string as far as it got)."""
    try:
        parsed = from_json(body, allow_partial="trailing-strings") if body else None
    except ValueError:
        return ()
    return prefix_blocks(body_text(parsed)) if isinstance(parsed, dict) else ()


@serve.ingress(router_api)
class IngressRouter:
    """HAProxy's router for one model's application (module docstring)."""

    def __init__(self, engine: DeploymentHandle):
        self._engine = engine

    @router_api.post("/internal/route")
    async def route(self, request: Request) -> JSONResponse:
        query = RouteQuery(blocks=body_blocks(await request.body()))
        try:
            async with self._engine.choose_replica(query, _reserve=False) as selection:
                replica = selection._replica.replica_id.to_full_id_str()  # HAProxy's key
        except Exception as exc:  # no replica now: HAProxy answers 503 (shaped, with Retry-After)
            return JSONResponse({"detail": f"no replica: {type(exc).__name__}"}, status_code=503)
        return JSONResponse({"replica_id": replica})


def with_ingress_router(app: serve.Application, model: ModelConfig) -> serve.Application:
    """``app`` (whose ingress is the model's engine deployment) with its ingress request router,
    where the model routes by prefix and HAProxy is on the public port (as Serve's builder in
    this process sees it). Serve refuses a custom request router on an ingress deployment under
    HAProxy without one; behind Serve's proxy, the proxy's handle routes by prefix itself."""
    from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY

    if not model.routes_by_prefix() or not RAY_SERVE_ENABLE_HA_PROXY:
        return app
    router = serve.deployment(IngressRouter, name=f"router-{model.name}",
                              # HAProxy's hop for every request: never the bottleneck, placed
                              # anywhere (no CPU reserved).
                              max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
    return app._with_ingress_request_router(router.bind(app))

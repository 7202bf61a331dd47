"""AICI's REST bodies (``docs/protocols/aici.md``, "REST API"), decoded in one validation pass."""

from __future__ import annotations

import math
from typing import Any, TypeVar

import msgspec

from protocols.aici.errors import APIError
from protocols.jsonbody import BodyError, decode_json

__all__ = ["RunRequest", "TagsRequest", "decode"]

T = TypeVar("T")


class RunRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/run``. ``model`` is this gateway's addition (AICI's server hosts one model):
    without it, the only served model, or the first that runs controllers."""

    controller: str
    controller_arg: Any = ""  # a string; an object or list is sent as its JSON
    prompt: str = ""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if not self.controller.strip():
            raise ValueError("controller must name a controller (a tag, a module id or none)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


class TagsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/controllers/tags``."""

    module_id: str
    tags: list[str]


def decode(body: bytes, kind: type[T]) -> T:
    try:
        return decode_json(body, kind)
    except (msgspec.ValidationError, BodyError) as exc:
        raise APIError(400, f"invalid request body: {exc}") from None

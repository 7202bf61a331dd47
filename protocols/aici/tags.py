"""Controller tags: names for controller module ids (``docs/protocols/aici.md``, "Controller tags").

The engines report the controllers they host (``ModelInfo.controllers``); tags users set here
point at those module ids. A :class:`TagStore` keeps the user-set ones: this process's
:class:`LocalTagStore` by default; the gateway may put one shared by all its ingress replicas
at ``app.state.aici_tags``.
"""

from __future__ import annotations

import time
from typing import Protocol

from contract.controller_tags import MAX_TAGS_PER_REQUEST, MAX_USER_TAGS, check_tags

__all__ = ["MAX_TAGS_PER_REQUEST", "MAX_USER_TAGS", "LocalTagStore", "TagStore", "check_tags",
           "tag_info"]


class TagStore(Protocol):
    async def tags(self) -> dict[str, dict]: ...

    async def set(self, infos: list[dict]) -> None: ...


class LocalTagStore:
    def __init__(self) -> None:
        self._tags: dict[str, dict] = {}

    async def tags(self) -> dict[str, dict]:
        return dict(self._tags)

    async def set(self, infos: list[dict]) -> None:
        for info in infos:  # re-set tags move to the end: the store keeps set order
            self._tags.pop(info["tag"], None)
            self._tags[info["tag"]] = info


def tag_info(tag: str, module_id: str, user: str, at: int | None = None) -> dict:
    """AICI's TagInfo (sizes are 0: these controllers are not Wasm)."""
    return {"tag": tag, "module_id": module_id,
            "updated_at": int(time.time()) if at is None else at, "updated_by": user,
            "wasm_size": 0, "compiled_size": 0}

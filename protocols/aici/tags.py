"""Controller tags: names for controller module ids (``docs/protocols/aici.md``, "Controller tags").

The engines report the controllers they host (``ModelInfo.controllers``); tags users set here
point at those module ids. A :class:`TagStore` keeps the user-set ones: this process's
:class:`LocalTagStore` by default; the gateway may put one shared by all its ingress replicas
at ``app.state.aici_tags``.
"""

from __future__ import annotations

import re
import time
from typing import Protocol

__all__ = ["MAX_TAGS_PER_REQUEST", "MAX_USER_TAGS", "LocalTagStore", "TagStore", "check_tags",
           "tag_info"]

_TAG = re.compile(r"[A-Za-z0-9_\-.]{1,50}")  # fullmatch: no trailing newline
_HEXISH = re.compile(r"[0-9a-fA-F]{20,}")  # would read as a module id
MAX_TAGS_PER_REQUEST = 16
MAX_USER_TAGS = 1000


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


def check_tags(tags: list[str], user: str, admin: bool, builtin: set[str]) -> str | None:
    """Why ``tags`` may not be set by this user (None: they may). Non-admins only name tags
    under their own user name (``alice.mytag``), as AICI's runtime requires; nobody renames
    the engines' own controllers (a tag named ``llguidance`` would redirect everyone's)."""
    if not tags:
        return "tags must not be empty"
    if len(tags) > MAX_TAGS_PER_REQUEST:
        return f"at most {MAX_TAGS_PER_REQUEST} tags per request"
    for tag in tags:
        if tag in builtin or tag == "none":
            return f"{tag!r} names a built-in controller"
        if not _TAG.fullmatch(tag) or _HEXISH.fullmatch(tag):
            return (f"invalid tag name {tag!r}: 1-50 letters, digits, '_', '-', '.', and not "
                    f"a module id")
        if not admin and not tag.startswith(f"{user}."):
            return f"permission denied for tag name {tag!r}: tags of user {user!r} start with " \
                   f"'{user}.'"
    return None

"""Controller tag names: the one set of rules, for AICI's REST API (``protocols/aici/tags.py``)
and the controller runtime's ``set_tags`` (``engines/controllers/runtime/tags.py``).

A neutral module (it imports nothing of this project) that the engines may import, as they do
``contract`` (``pyproject.toml``'s import-linter contracts). The rules:
``docs/protocols/aici.md``, "Controller tags".
"""

from __future__ import annotations

import re
from collections.abc import Set

__all__ = ["MAX_TAGS_PER_REQUEST", "MAX_USER_TAGS", "check_tags"]

_TAG = re.compile(r"[A-Za-z0-9_\-.]{1,50}")  # fullmatch: no trailing newline
_HEXISH = re.compile(r"[0-9a-fA-F]{20,}")  # would read as a module id
MAX_TAGS_PER_REQUEST = 16
MAX_USER_TAGS = 1000


def check_tags(tags: object, user: str, admin: bool, builtin: Set[str]) -> str | None:
    """Why ``tags`` may not be set by this user (None: they may). Non-admins only name tags
    under their own user name (``alice.mytag``), as AICI's runtime requires; nobody renames
    the engines' own controllers (a tag named ``llguidance`` would redirect everyone's)."""
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        return "tags must be a list of strings"
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

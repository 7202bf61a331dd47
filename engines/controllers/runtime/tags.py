"""The runtime's controller registry: module ids of the built-in controllers and the tags
that name them (the seed's ``get_tags`` / ``set_tags``; the naming rules are
``contract.controller_tags``'s, shared with AICI's REST API)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping

from contract.controller_tags import MAX_USER_TAGS, check_tags
from engines.controllers.api.base import Controller, ControllerContext
from engines.controllers.ipc.channels import error_reply, ok_reply
from engines.controllers.ipc.messages import Auth, Reply, SetTags, TagInfo, TagList

__all__ = ["ControllerFactory", "TagRegistry", "module_id_of"]

ControllerFactory = Callable[[ControllerContext, str, list[int]], Controller]


def module_id_of(factory: ControllerFactory) -> str:
    """A built-in's module id: sha256 hex, like a Wasm module's, of its import path."""
    path = f"{factory.__module__}:{getattr(factory, '__qualname__', repr(factory))}"
    return hashlib.sha256(path.encode()).hexdigest()


class TagRegistry:
    def __init__(self, controllers: Mapping[str, ControllerFactory]) -> None:
        self._lock = threading.Lock()  # set_tags on the side channel's thread, lookups on others
        self._modules: dict[str, ControllerFactory] = {}
        self._tags: dict[str, TagInfo] = {}
        self._builtin = frozenset(controllers)  # tags nobody may set (check_tags)
        started = int(time.time())
        for tag, factory in controllers.items():
            module_id = module_id_of(factory)
            self._modules[module_id] = factory
            self._tags[tag] = TagInfo(tag, module_id, started, "builtin")

    def names(self) -> list[str]:
        with self._lock:
            return list(self._tags)

    def factory(self, module: object) -> ControllerFactory | None:
        """The controller a module id or a tag names."""
        with self._lock:
            if not isinstance(module, str):
                return None
            tagged = self._tags.get(module)
            return self._modules.get(module) or (
                self._modules.get(tagged.module_id) if tagged is not None else None)

    def get_tags(self) -> Reply:
        with self._lock:
            tags = sorted(self._tags.values(), key=lambda t: t.updated_at, reverse=True)
        return ok_reply(TagList(tags))

    def set_tags(self, request: SetTags, auth: Auth) -> Reply:
        module_id, tags = request.module_id, request.tags
        if module_id not in self._modules:
            return error_reply(f"unknown module_id {module_id!r}", is_user_error=True)
        with self._lock:
            users = len(self._tags) - len(self._builtin)
        why = check_tags(tags, auth.user, auth.is_admin, self._builtin)
        if why is None and users + len(tags) > MAX_USER_TAGS:
            why = f"at most {MAX_USER_TAGS} user tags"
        if why is not None:
            return error_reply(why, is_user_error=True)
        now = int(time.time())
        infos = [TagInfo(tag, module_id, now, auth.user) for tag in tags]
        with self._lock:
            self._tags.update({info.tag: info for info in infos})
        return ok_reply(TagList(infos))

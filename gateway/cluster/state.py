"""What the gateway keeps for the whole cluster: its named, detached Ray actors (the tenants'
ledger, the batch host) and their files in the state directory (docs/tenancy.md,
docs/protocols/batches.md)."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["NAMESPACE", "named_actor", "write_atomically"]

NAMESPACE = "llm-gateway"
# Ray's resource of the head node: the actors whose files live in the state directory run
# there, on the disk that holds it.
_HEAD_NODE = {"node:__internal_head__": 0.001}


async def named_actor(actor_class: Any, name: str, *args: Any, **options: Any) -> Any:
    """The actor named ``name``, found or started (by the first process that needs it) on the
    head node; Ray restarts it if its process dies. The lookup and the start block: off the
    event loop."""
    settings = {"name": name, "namespace": NAMESPACE, "lifetime": "detached",
                "get_if_exists": True, "max_restarts": -1, "resources": _HEAD_NODE, **options}
    return await asyncio.to_thread(actor_class.options(**settings).remote, *args)


def write_atomically(path: Path, raw: bytes) -> None:
    """``path`` holds ``raw``, or what it held before: never a part of either."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as out:
        out.write(raw)
        out.flush()
        os.fsync(out.fileno())
    os.replace(out.name, path)

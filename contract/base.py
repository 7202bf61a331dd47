"""The base of every message of the engine contract (docs/engines.md)."""

from __future__ import annotations

import msgspec

__all__ = ["Frozen"]


class Frozen(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Immutable, keyword-only, and encoded without its defaults (smaller on the wire)."""

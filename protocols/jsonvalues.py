"""Type checks for decoded JSON values, shared by the hand-validated protocols.

JSON ``true`` decodes to Python ``True``, which is an ``int``: protocols that distinguish
integers, numbers and booleans (LMTP, MindIE) must exclude ``bool`` explicitly.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_int", "is_number"]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

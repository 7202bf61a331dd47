"""Decoding a request body or an LMTP frame as JSON, with one fixed message per failure class.

A parser's own message is Python's text ("'utf-8' codec can't decode byte 0xff in position 0",
"maximum recursion depth exceeded while deserializing an object", "... use
sys.set_int_max_str_digits()"): no client gets one. Every protocol decodes through here and
puts the :class:`BodyError`'s message into its own error shape (docs/reliability.md).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

__all__ = ["BodyError", "decode_json"]

T = TypeVar("T")

NOT_UTF8 = "the body is not valid UTF-8"
TOO_DEEP = "the JSON nests too deeply"
OUT_OF_RANGE = "a number in the JSON is out of range"
TRUNCATED = "the JSON ends too early"
_BYTE = re.compile(r"\(byte (\d+)\)")


class BodyError(ValueError):
    """Not JSON at all; the message is one of this module's fixed texts."""


def decode_json(data: bytes | str, type: type[T] | Any = Any) -> T:
    """``data`` as JSON, typed by ``type`` when one is given (a typed field's type error is a
    ``msgspec.ValidationError`` whose message names the field: the caller's to shape)."""
    try:
        return msgspec.json.decode(data, type=type)
    except msgspec.ValidationError:
        if type is Any:  # untyped: only a number beyond 64 bits gets here
            raise BodyError(OUT_OF_RANGE) from None
        raise
    except UnicodeError:  # msgspec's report of invalid UTF-8 (or a lone surrogate in a str)
        raise BodyError(NOT_UTF8) from None
    except RecursionError:
        raise BodyError(TOO_DEEP) from None
    except msgspec.DecodeError as exc:
        raise BodyError(_malformed(str(exc))) from None


def _malformed(message: str) -> str:
    if "truncated" in message:
        return TRUNCATED
    at = _BYTE.search(message)
    return "the body is not valid JSON" + (f" (at byte {at.group(1)})" if at else "")

"""LMTP framing: ``COMMAND <json object>`` from the client, ``TYPE <json array>`` back."""

from __future__ import annotations

import json
from typing import Any

from protocols.jsonbody import BodyError, decode_json

__all__ = ["FrameError", "format_frame", "parse_frame", "salvage_stream_id"]


class FrameError(ValueError):
    """A frame that can't be parsed; ``stream_id`` is set when one could still be recovered."""

    def __init__(self, message: str, stream_id: Any = None):
        super().__init__(message)
        self.stream_id = stream_id


def parse_frame(text: str) -> tuple[str, dict[str, Any]]:
    """Split on the first space and decode the JSON object after it."""
    command, sep, body = text.partition(" ")
    if not sep or not command:
        raise FrameError(f"malformed frame: expected 'COMMAND {{json}}', got {text[:80]!r}")
    try:
        payload = decode_json(body)
    except BodyError as exc:
        raise FrameError(f"malformed JSON in {command} frame: {exc}",
                         salvage_stream_id(body)) from None
    if not isinstance(payload, dict):
        raise FrameError(f"{command} payload must be a JSON object")
    return command, payload


def salvage_stream_id(body: str) -> Any:
    # A truncated or broken frame often still names its stream: answer on it so the client's
    # iterator for that stream ends instead of hanging.
    marker = '"stream_id"'
    at = body.find(marker)
    if at < 0:
        return None
    rest = body[at + len(marker):].lstrip().removeprefix(":").lstrip()
    try:
        value, _ = json.JSONDecoder().raw_decode(rest)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, (int, str)) and not isinstance(value, bool) else None


def format_frame(kind: str, items: list[dict[str, Any]]) -> str:
    # allow_nan=False: non-finite floats are not JSON and strict clients choke on them; the
    # encoders drop such values before they get here.
    return f"{kind} {json.dumps(items, separators=(',', ':'), allow_nan=False)}"

"""Bytes on the wire: exactly `data: <json>` LF LF per event, `data: [DONE]` last, no comments or pings.

Benchmark clients split on LF LF and strip a literal "data: " (OPENAI_PROTOCOL.md §0, §6.1), so the
framing is built here by hand rather than by an SSE library with other defaults.
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"

STREAM_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

MEDIA_TYPE = "text/event-stream"


def event(payload: dict[str, Any]) -> bytes:
    """One event. orjson never emits raw newlines, NaN or Infinity (it writes null for non-finite floats)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


TEXT_MARK = "\u0000tally:text\u0000"  # stands for the text in a template chunk; no real chunk holds it


def text_template(payload: dict[str, Any]) -> tuple[bytes, bytes] | None:
    """The bytes around the text in events like `payload` (TEXT_MARK standing for the text): an event for
    a text is then `prefix`, `orjson.dumps(text)`, `suffix`, without building or dumping a dict.

    The template is cut from `event(payload)` itself, so it cannot drift from the dict path: for any
    text, `prefix + orjson.dumps(text) + suffix == event(p with TEXT_MARK replaced by text)`. None when
    the mark is not in the payload exactly once.
    """
    parts = event(payload).split(orjson.dumps(TEXT_MARK))
    if len(parts) != 2:
        return None
    return parts[0], parts[1]


def error_event(message: str, code: int | str | None = 500) -> bytes:
    """An in-band error after the first byte; openai-python raises APIError on it. [DONE] follows."""
    return event({"error": {"message": message, "type": "server_error", "param": None, "code": code}})

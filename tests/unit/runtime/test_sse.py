"""Bytes on the wire: the text template equals dumping the chunk dict."""

from __future__ import annotations

import orjson

from tally_runtime import sse
from tally_runtime.streaming import ResponseHeader

TEXTS = ["", " tok", "naïve 日本語 🎉", 'quote " and \\ backslash', "new\nline\ttab\r", "\x00\x1f\u2028", "data: x\n\n"]


def test_text_template_equals_dumping_the_dict() -> None:
    header = ResponseHeader("cmpl-1", 7, 'model "quoted" \\ 🎉')
    template = sse.text_template(header.envelope("text_completion", [{"index": 3, "text": sse.TEXT_MARK}], None))
    assert template is not None
    prefix, suffix = template
    for text in TEXTS:
        expected = sse.event(header.envelope("text_completion", [{"index": 3, "text": text}], None))
        assert prefix + orjson.dumps(text) + suffix == expected


def test_text_template_refuses_a_payload_without_exactly_one_mark() -> None:
    assert sse.text_template({"text": "plain"}) is None
    assert sse.text_template({"a": sse.TEXT_MARK, "b": sse.TEXT_MARK}) is None

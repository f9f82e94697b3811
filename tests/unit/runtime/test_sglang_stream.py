"""SGLang items -> deltas: ids SGLang <= 0.5.9 drops under backlog are known loss, not a mismatch."""

from __future__ import annotations

import pytest

from tally_runtime.engine.sglang_stream import ChoiceStream, StreamModeViolation, StreamShape


def test_ids_sglang_dropped_under_backlog_are_counted_as_dropped() -> None:
    """<= 0.5.9: a coalesced item carries only the newest delta id; completion_tokens stays right."""
    stream = ChoiceStream(StreamShape(False, True, True, drops_backlog_ids=True), str)
    first = stream.convert({"text": "a", "output_ids": [1], "meta_info": {"completion_tokens": 1}})
    late = stream.convert({"text": "abcd", "output_ids": [4], "meta_info": {"completion_tokens": 4}})
    last = stream.convert({"text": "abcde", "output_ids": [5], "meta_info": {
        "completion_tokens": 5, "finish_reason": {"type": "length", "length": 5}}})
    assert [(d.token_ids, d.dropped_ids, d.text) for d in (first, late, last)] == [
        ((1,), 0, "a"), ((4,), 2, "bcd"), ((5,), 0, "e")]


def test_generations_that_keep_every_id_drop_none() -> None:
    stream = ChoiceStream(StreamShape(False, False), str)
    delta = stream.convert({"text": "ab", "output_ids": [1, 2], "meta_info": {"completion_tokens": 2}})
    assert delta.dropped_ids == 0


def test_cumulative_items_to_an_incremental_consumer_fail_loudly() -> None:
    """The 'ThreeThree colors' bug: cumulative ids/text treated as deltas. It must raise, not relay."""
    stream = ChoiceStream(StreamShape(ids_cumulative=False, text_cumulative=False), str)
    items = [{"text": "Three", "output_ids": [1], "meta_info": {"completion_tokens": 1, "prompt_tokens": 2}},
             {"text": "Three colors", "output_ids": [1, 2], "meta_info": {"completion_tokens": 2, "prompt_tokens": 2}}]
    assert stream.convert(items[0]).text == "Three"
    with pytest.raises(StreamModeViolation):
        stream.convert(items[1])


def test_cumulative_consumer_slices_text_and_ids() -> None:
    stream = ChoiceStream(StreamShape(ids_cumulative=True, text_cumulative=True), str)
    texts, ids = [], []
    for n, text in enumerate(["Three", "Three colors", "Three colors of"], start=1):
        delta = stream.convert({"text": text, "output_ids": list(range(n)), "meta_info": {"completion_tokens": n}})
        texts.append(delta.text)
        ids += delta.token_ids
    assert "".join(texts) == "Three colors of" and ids == [0, 1, 2]

"""SGLang items -> deltas: ids SGLang <= 0.5.9 drops under backlog are known loss, not a mismatch; the plain
fast path gives exactly what the general path gives."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tally_runtime.engine.base import Delta
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


def random_item(rng: random.Random, emitted: int) -> dict[str, Any]:
    """A plain-stream item, well-formed most of the time; otherwise a field missing, None or odd."""
    ids = [rng.randrange(100) for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))]
    meta: dict[str, Any] = {"id": "r", "finish_reason": None, "prompt_tokens": 4,
                            "completion_tokens": emitted + len(ids) + rng.choice([0, 0, 0, 1, -1]),
                            "cached_tokens": rng.choice([0, 2]), "reasoning_tokens": rng.choice([0, 0, 3])}
    item: dict[str, Any] = {"text": rng.choice(["a", " tok", "", "é"]), "output_ids": ids, "meta_info": meta}
    odd = rng.randrange(12)
    if odd == 0:
        del meta[rng.choice(list(meta))]
    elif odd == 1:
        meta[rng.choice(["completion_tokens", "prompt_tokens", "cached_tokens"])] = None
    elif odd == 2:
        item[rng.choice(["text", "output_ids"])] = None
    elif odd == 3:
        del item[rng.choice(["text", "output_ids", "meta_info"])]
    elif odd == 4:
        meta["finish_reason"] = {"type": "length", "length": 9}
    return item


def test_the_plain_fast_path_gives_what_the_general_path_gives() -> None:
    """`convert` takes well-formed unfinished items of a plain stream as they are; for every item, odd ones
    included, its delta (or its refusal) is the general path's, and the fast path does run."""
    rng = random.Random(30)
    fast_taken = 0
    for _ in range(300):
        fast = ChoiceStream(StreamShape(False, False), str)
        general = ChoiceStream(StreamShape(False, False), str)
        assert fast.plain
        for _ in range(rng.randint(1, 12)):
            item = random_item(rng, fast.ids_emitted)
            before = fast.ids_emitted
            try:
                expected: Delta | type[Exception] = general.convert_general(item)
            except StreamModeViolation:
                expected = StreamModeViolation
            try:
                got: Delta | type[Exception] = fast.convert(item)
            except StreamModeViolation:
                got = StreamModeViolation
            assert got == expected, item
            assert (fast.ids_emitted, fast.ids_dropped) == (general.ids_emitted, general.ids_dropped)
            meta = item.get("meta_info") or {}
            fast_taken += isinstance(got, Delta) and meta.get("finish_reason") is None and fast.ids_emitted > before
            if got is StreamModeViolation:
                break
    assert fast_taken > 500


def test_the_fast_path_is_taken_for_a_plain_item(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = ChoiceStream(StreamShape(False, False), str)
    monkeypatch.setattr(ChoiceStream, "convert_general", lambda self, item: pytest.fail("general path"))
    delta = stream.convert({"text": " tok", "output_ids": [7], "meta_info": {
        "finish_reason": None, "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}})
    assert delta == Delta(" tok", (7,), None, 1, 1, 0, None)


@pytest.mark.parametrize("shape", [StreamShape(True, True), StreamShape(False, True),
                                   StreamShape(False, False, drops_backlog_ids=True)])
def test_only_a_plain_stream_without_logprobs_takes_the_fast_path(shape: StreamShape) -> None:
    assert not ChoiceStream(shape, str).plain
    assert not ChoiceStream(StreamShape(False, False), str, want_logprobs=True).plain

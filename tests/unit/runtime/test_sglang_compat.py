"""The start-up probe decides how SGLang really streams ids, text and logprob lists (SGLANG_CONTRACT.md §1.4-5)."""

from __future__ import annotations

import pytest

from tally_runtime.engine.sglang_compat import Generation, ProbeItem, expected_shape, probe_shape

WORDS = [" jumps", " over", "", " the", " lazy", " dog", "\u00e9", "."]  # "" = part of a multi-byte character


FULL = "".join(WORDS)


A = expected_shape(Generation.A, incremental=True)


def cumulative_text(ids_cumulative: bool = False, logprobs: bool = False) -> list[ProbeItem]:
    out, text = [], ""
    for n, word in enumerate(WORDS, start=1):
        text += word
        ids = tuple(range(n)) if ids_cumulative else (n,)
        out.append(ProbeItem(text, ids, n, n if logprobs else 1))
    return out


def delta_text() -> list[ProbeItem]:
    return [ProbeItem(word, (n,), n, 1) for n, word in enumerate(WORDS, start=1)]


D = expected_shape(Generation.D, incremental=True)


@pytest.mark.parametrize("full_text", [FULL, None], ids=["decoded", "undecodable"])
def test_cumulative_text_with_an_item_that_adds_no_printable_text(full_text: str | None) -> None:
    """Generations A/B: one item repeats the text (a partial UTF-8 character). Still cumulative."""
    shape = probe_shape(cumulative_text(), A, full_text)
    assert shape.text_cumulative and not shape.ids_cumulative


def test_delta_text_whose_pieces_happen_to_be_prefixes_of_each_other() -> None:
    items = [ProbeItem(t, (n,), n, 1) for n, t in enumerate([" a", " a", " ab", "."], start=1)]
    assert not probe_shape(items, A, " a a ab.").text_cumulative  # the pieces add up to the text: deltas
    assert not probe_shape(delta_text(), A, FULL).text_cumulative


def test_one_item_cannot_tell_so_the_declared_shape_stands() -> None:
    items = [ProbeItem("all at once", (1, 2, 3), 3, 3)]
    assert probe_shape(items, A, "all at once").text_cumulative is True
    assert probe_shape(items, D, "all at once").text_cumulative is False


def test_cumulative_ids_and_logprob_lists_are_seen() -> None:
    shape = probe_shape(cumulative_text(ids_cumulative=True, logprobs=True), D, FULL)
    assert shape.ids_cumulative and shape.text_cumulative and shape.logprobs_cumulative


def test_sglang_0_5_10_cumulative_logprobs_in_incremental_mode() -> None:
    """Generation C declares sliced lists; 0.5.10 still sends them whole (§1.1). The probe wins."""
    items = [ProbeItem(word, (n,), n, n) for n, word in enumerate(WORDS, start=1)]
    shape = probe_shape(items, expected_shape(Generation.C, incremental=True), FULL)
    assert shape.logprobs_cumulative and not shape.ids_cumulative and not shape.text_cumulative
    sliced = probe_shape(delta_text(), expected_shape(Generation.C, incremental=True), FULL)
    assert not sliced.logprobs_cumulative

"""Unit tests of stops."""

from __future__ import annotations

import pytest

from tally_runtime.engine.stops import StopMatcher


@pytest.mark.parametrize(("stops", "pieces", "emitted", "stopped"), [
    pytest.param(["END"], ["Hello ", "wor", "ld"], "Hello world", False, id="no-stop"),
    pytest.param(["END"], ["Hello E", "N", "D more"], "Hello ", True, id="split-across-pieces"),
    pytest.param(["END"], ["Hello E", "NOUGH"], "Hello ENOUGH", False, id="partial-released"),
    pytest.param(["\n\n", "x"], ["a\n", "b\n", "\nc"], "a\nb", True, id="earliest-of-several"),
    pytest.param(["ab"], ["xa", "a", "b"], "xa", True, id="overlapping-prefix"),
])
def test_stop_matcher(stops: list[str], pieces: list[str], emitted: str, stopped: bool) -> None:
    matcher = StopMatcher(stops)
    out = "".join(matcher.feed(p) for p in pieces) + matcher.flush()
    assert out == emitted
    assert matcher.stopped is stopped


def test_partial_match_is_held_back_not_retracted() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("go ST") == "go "
    assert matcher.feed("O") == ""
    assert matcher.feed("P!") == ""
    assert matcher.stopped

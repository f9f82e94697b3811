"""The counter journal: it round-trips, the series continue from it, and a write failure fails nothing."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from tally_runtime.engine.base import Delta, FinishReason
from tally_runtime.usage import ChoiceUsage, request_usage


def finished(index: int, prompt_index: int, deltas: list[Delta], prompt_len: int = 99) -> ChoiceUsage:
    usage = ChoiceUsage(index, prompt_index, prompt_len)
    for delta in deltas:
        usage.observe(delta)
    return usage


def series(metrics: Any) -> dict[str, float]:
    """Every sample except the `_created` timestamps prometheus_client adds to counters."""
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(metrics.registry).decode()
    return {f"{s.name}{sorted(s.labels.items())}" if s.labels else s.name: s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_the_journal_round_trips_and_the_series_continue_from_it(tmp_path: Any) -> None:
    from tally_runtime.ledger import Journal
    from tally_runtime.metrics import Metrics

    first = Metrics()
    first.record_request("completions", "ok", "length")
    first.record_usage(request_usage([finished(0, 0, [Delta(token_ids=(1, 2), prompt_tokens=4, completion_tokens=2,
                                                            cached_tokens=1, finish_reason=FinishReason.LENGTH)])]))
    journal = Journal(tmp_path / "usage.json")
    journal.write(first.totals)
    resumed = journal.load()
    assert resumed == first.totals
    second = Metrics(totals=resumed)
    assert series(second) == series(first) and series(first)["tally_completion_tokens_total"] == 2


def test_a_journal_that_cannot_be_written_never_fails_the_request(tmp_path: Any) -> None:
    from tally_runtime.ledger import Journal, Totals

    journal = Journal(tmp_path / "missing-dir" / "usage.json")
    journal.write(Totals())
    assert journal.failing and journal.load() is None


def test_a_shorter_snapshot_leaves_no_stale_tail(tmp_path: Any) -> None:
    from tally_runtime.ledger import Journal, Totals

    journal = Journal(tmp_path / "usage.json")
    journal.write(Totals(epoch=1.0, requests={f"completions|ok|r{i}": 1.0 for i in range(20)}))
    short = Totals(epoch=1.0, prompt_tokens=3.0)
    journal.write(short)
    journal.close()
    assert Journal(tmp_path / "usage.json").load() == short
    reopened = Journal(tmp_path / "usage.json")  # a restarted process keeps writing over the same file
    reopened.write(Totals(epoch=1.0, prompt_tokens=4.0))
    assert Journal(tmp_path / "usage.json").load() == Totals(epoch=1.0, prompt_tokens=4.0)


from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from tally_runtime.engine.base import Delta, EngineMetrics, FinishReason
from tally_runtime.usage import ChoiceUsage, request_usage


def finished(index: int, prompt_index: int, deltas: list[Delta], prompt_len: int = 99) -> ChoiceUsage:
    usage = ChoiceUsage(index, prompt_index, prompt_len)
    for delta in deltas:
        usage.observe(delta)
    return usage


def test_engine_counts_win_over_streamed_ids() -> None:
    choice = finished(0, 0, [Delta(text="ab", token_ids=(1, 2, 3), prompt_tokens=5, completion_tokens=3),
                             Delta(token_ids=(4,), completion_tokens=4, finish_reason=FinishReason.STOP)])
    usage = request_usage([choice])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.derived, usage.mismatched_choices) == (5, 4, False, 0)


def test_prompt_counted_once_per_prompt_completions_summed() -> None:
    deltas = [Delta(token_ids=(1, 2), prompt_tokens=7, completion_tokens=2, cached_tokens=3,
                    finish_reason=FinishReason.LENGTH)]
    other = [Delta(token_ids=(1, 2), prompt_tokens=4, completion_tokens=2, cached_tokens=0,
                   finish_reason=FinishReason.LENGTH)]
    choices = [finished(0, 0, deltas), finished(1, 0, deltas), finished(2, 1, other), finished(3, 1, other)]
    usage = request_usage(choices).as_openai()
    assert usage == {"prompt_tokens": 11, "completion_tokens": 8, "total_tokens": 19,
                     "prompt_tokens_details": {"cached_tokens": 3}}


def test_mismatch_when_engine_count_differs_from_ids_streamed() -> None:
    # the SGLang "triangular" bug: cumulative ids treated as deltas inflate what was streamed
    choice = finished(0, 0, [Delta(token_ids=(1,), completion_tokens=1),
                             Delta(token_ids=(1, 2), completion_tokens=2, finish_reason=FinishReason.LENGTH)])
    assert choice.mismatched
    assert request_usage([choice]).mismatched_choices == 1


def test_derived_usage_when_engine_reports_nothing() -> None:
    choice = finished(0, 0, [Delta(token_ids=(1, 2, 3), finish_reason=FinishReason.STOP)], prompt_len=6)
    usage = request_usage([choice])
    assert usage.derived and usage.completion_tokens == 3 and usage.prompt_tokens == 6


def test_abort_item_without_prompt_count_keeps_previous() -> None:
    choice = finished(0, 0, [Delta(token_ids=(1,), prompt_tokens=9, completion_tokens=1),
                             Delta(completion_tokens=1, finish_reason=FinishReason.ABORT)])
    assert choice.prompt_tokens == 9


def test_reasoning_tokens_reported_in_details() -> None:
    choice = finished(0, 0, [Delta(token_ids=(1, 2), prompt_tokens=1, completion_tokens=2, reasoning_tokens=1,
                                   finish_reason=FinishReason.STOP)])
    assert request_usage([choice]).as_openai()["completion_tokens_details"] == {"reasoning_tokens": 1}


def test_a_choice_the_engine_never_reported_on_bills_nothing_and_is_not_derived() -> None:
    """n=2, the stream closed while choice 1 was still in prefill: only choice 0's counts are billed."""
    reported = finished(0, 0, [Delta(token_ids=(1, 2), prompt_tokens=7, completion_tokens=2)])
    in_prefill = ChoiceUsage(1, 0, 99)
    usage = request_usage([reported, in_prefill])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.derived, usage.mismatched_choices) == (7, 2, False, 0)
    nothing = request_usage([ChoiceUsage(0, 0, 99), ChoiceUsage(1, 0, 99)])
    assert (nothing.prompt_tokens, nothing.completion_tokens, nothing.derived) == (0, 0, False)


def test_prompt_comes_from_any_choice_that_reported_it() -> None:
    late = finished(1, 0, [Delta(token_ids=(1,), prompt_tokens=7, completion_tokens=1)])
    assert request_usage([ChoiceUsage(0, 0, 99), late]).prompt_tokens == 7


def test_ids_the_engine_dropped_are_known_loss_not_a_mismatch() -> None:
    # SGLang <= 0.5.9 under backlog: an item carries only its newest id, completion_tokens is still right
    choice = finished(0, 0, [Delta(token_ids=(1,), completion_tokens=1),
                             Delta(token_ids=(4,), completion_tokens=4, dropped_ids=2,
                                   finish_reason=FinishReason.LENGTH)])
    assert not choice.mismatched and request_usage([choice]).completion_tokens == 4


def test_running_usage_is_the_count_as_of_each_delta() -> None:
    choice = ChoiceUsage(0, 0, 3)
    seen = []
    for count in range(1, 5):
        choice.observe(Delta(token_ids=(count,), prompt_tokens=3, completion_tokens=count))
        seen.append(choice.running_usage()["completion_tokens"])
    assert seen == [1, 2, 3, 4]
    assert choice.running_usage(0) == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


def sglang_text(prompt: float, generation: float) -> bytes:
    return (b'# TYPE sglang:prompt_tokens counter\n'
            b'sglang:prompt_tokens_total{is_streaming="true"} %.1f\n'
            b'sglang:prompt_tokens_total{is_streaming="false"} 0.0\n'
            b'# TYPE sglang:generation_tokens counter\nsglang:generation_tokens_total %.1f\n' % (prompt, generation))


def engine_numbers(prompt: float, generation: float) -> EngineMetrics:
    """What the SGLang adapter reports: its series, and the token totals summed over their label sets."""
    from tally_runtime.engine.sglang_metrics import engine_totals

    text = sglang_text(prompt, generation)
    totals = engine_totals(text.decode())
    assert totals == {"sglang:prompt_tokens_total": prompt, "sglang:generation_tokens_total": generation}
    return EngineMetrics(text, totals["sglang:prompt_tokens_total"], totals["sglang:generation_tokens_total"])


def test_drift_against_sglang_counters_counts_the_prompt_per_choice() -> None:
    from tally_runtime.metrics import Metrics

    metrics = Metrics()
    # one request, n=2 on a 5-token prompt: billed once (5), but SGLang ran two requests and counted 10
    two = [finished(i, 0, [Delta(token_ids=(1,) * 15, prompt_tokens=5, completion_tokens=15,
                                 finish_reason=FinishReason.LENGTH)]) for i in range(2)]
    metrics.record_usage(request_usage(two))
    text = metrics.render(engine_numbers(10, 25)).decode()
    assert 'tally_engine_usage_drift_tokens{kind="prompt"} 0.0' in text
    assert 'tally_engine_usage_drift_tokens{kind="completion"} 5.0' in text
    assert text.endswith(sglang_text(10, 25).decode())


def test_drift_is_only_taken_when_settled() -> None:
    """SGLang counts a request before its last item reaches us: mid-request readings are not drift."""
    from tally_runtime.metrics import Metrics

    metrics = Metrics()
    metrics.render(engine_numbers(0, 0))
    text = metrics.render(engine_numbers(4, 8), settled=False).decode()  # finished in SGLang, not yet here
    assert 'tally_engine_usage_drift_tokens{kind="completion"} 0.0' in text


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


def series(metrics: Any) -> dict[str, float]:
    """Every sample except the `_created` timestamps prometheus_client adds to counters."""
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(metrics.registry).decode()
    return {f"{s.name}{sorted(s.labels.items())}" if s.labels else s.name: s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_a_journal_that_cannot_be_written_never_fails_the_request(tmp_path: Any) -> None:
    from tally_runtime.ledger import Journal, Totals

    journal = Journal(tmp_path / "missing-dir" / "usage.json")
    journal.write(Totals())
    assert journal.failing and journal.load() is None

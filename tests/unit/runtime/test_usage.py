"""Usage accounting from the engine's own counts: per choice, per request, derived and mismatched."""

from __future__ import annotations

from tally_runtime.engine.base import Delta, FinishReason
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

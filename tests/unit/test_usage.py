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


def test_drift_against_sglang_counters() -> None:
    from tally_runtime.metrics import Metrics

    metrics = Metrics()
    metrics.prompt_tokens.inc(10)
    metrics.completion_tokens.inc(30)
    sglang_text = (b'# TYPE sglang:prompt_tokens counter\nsglang:prompt_tokens_total{is_streaming="true"} 6.0\n'
                   b'sglang:prompt_tokens_total{is_streaming="false"} 4.0\n'
                   b'# TYPE sglang:generation_tokens counter\nsglang:generation_tokens_total 25.0\n')
    text = metrics.render(sglang_text).decode()
    assert 'tally_engine_usage_drift_tokens{kind="prompt"} 0.0' in text
    assert 'tally_engine_usage_drift_tokens{kind="completion"} 5.0' in text
    assert text.endswith(sglang_text.decode())

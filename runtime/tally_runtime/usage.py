"""Usage accounting from the engine's own counts, with a fallback and a mismatch check.

`completion_tokens` is the engine's cumulative count as of a choice's last delta, never the
number of chunks sent. Only when an engine reports nothing do we count streamed token ids, and
that request is marked `derived`. Every finished choice compares the engine's count with the
ids actually streamed: a difference is a usage mismatch (see DESIGN.md, "Usage").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tally_runtime.engine.base import Delta, FinishReason


@dataclass(slots=True)
class ChoiceUsage:
    """One choice's usage as the engine reported it, plus what was actually streamed.

    A choice the engine never reported on (closed while still queued or in prefill, or ended by another
    choice's error) bills nothing and is neither derived nor mismatched: there is no count to trust or
    to check. Only a choice that produced output or finished without counts is `derived`.
    """

    index: int
    prompt_index: int
    prompt_len: int  # our tokenizer's count: the fallback only
    engine_prompt_tokens: int | None = None
    engine_completion_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    ids_streamed: int = 0
    ids_dropped: int = 0  # ids the engine counted but never sent (SGLang <= 0.5.9 under backlog)
    finish_reason: str | None = None

    def observe(self, delta: Delta) -> None:
        """Keep the last value the engine reported for each count (an abort item may lack some). An aborted
        choice's last delta is observed too: its counts say what the engine generated for it."""
        self.ids_streamed += len(delta.token_ids)
        self.ids_dropped += delta.dropped_ids
        if delta.prompt_tokens is not None:
            self.engine_prompt_tokens = delta.prompt_tokens
        if delta.completion_tokens is not None:
            self.engine_completion_tokens = delta.completion_tokens
        if delta.cached_tokens is not None:
            self.cached_tokens = delta.cached_tokens
        if delta.reasoning_tokens is not None:
            self.reasoning_tokens = delta.reasoning_tokens
        if delta.finish_reason is not None and delta.finish_reason != FinishReason.ABORT:
            self.finish_reason = str(delta.finish_reason)  # an aborted choice did not finish: None

    @property
    def derived(self) -> bool:
        return self.engine_completion_tokens is None and (self.finish_reason is not None or self.ids_streamed > 0)

    @property
    def mismatched(self) -> bool:
        engine = self.engine_completion_tokens
        return engine is not None and engine != self.ids_streamed + self.ids_dropped

    @property
    def prompt_tokens(self) -> int | None:
        """The engine's prompt count; ours only for a derived choice; None when nothing was reported."""
        if self.engine_prompt_tokens is not None:
            return self.engine_prompt_tokens
        return self.prompt_len if self.derived else None

    @property
    def completion_tokens(self) -> int:
        if self.engine_completion_tokens is not None:
            return self.engine_completion_tokens
        return self.ids_streamed

    def running_usage(self, completion: int | None = None) -> dict[str, Any]:
        """This choice's cumulative usage so far, for `continuous_usage_stats`."""
        prompt = self.engine_prompt_tokens if self.engine_prompt_tokens is not None else self.prompt_len
        return _usage_dict(prompt, self.completion_tokens if completion is None else completion, None, None)


@dataclass(frozen=True, slots=True)
class RequestUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    reasoning_tokens: int | None
    derived: bool
    mismatched_choices: int
    # The prompt as the engine counts it: once per choice (SGLang runs each choice as its own request).
    engine_prompt_tokens: int = 0

    def as_openai(self) -> dict[str, Any]:
        return _usage_dict(self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.reasoning_tokens)


def request_usage(choices: Sequence[ChoiceUsage]) -> RequestUsage:
    """Prompt counted once per prompt (from the first of its choices with a count), completions summed."""
    prompts: dict[int, ChoiceUsage] = {}
    for choice in sorted(choices, key=lambda c: c.index):
        if choice.prompt_tokens is not None:
            prompts.setdefault(choice.prompt_index, choice)
    cached = [c.cached_tokens for c in prompts.values() if c.cached_tokens is not None]
    reasoning = [c.reasoning_tokens for c in choices if c.reasoning_tokens is not None]
    return RequestUsage(
        prompt_tokens=sum(c.prompt_tokens or 0 for c in prompts.values()),
        completion_tokens=sum(c.completion_tokens for c in choices),
        cached_tokens=sum(cached) if cached else None,
        reasoning_tokens=sum(reasoning) if reasoning else None,
        derived=any(c.derived for c in choices),
        mismatched_choices=sum(1 for c in choices if c.mismatched),
        engine_prompt_tokens=sum(c.engine_prompt_tokens or 0 for c in choices),
    )


def _usage_dict(prompt: int, completion: int, cached: int | None, reasoning: int | None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage

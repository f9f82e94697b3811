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

from tally_runtime.engine.base import Delta


@dataclass(slots=True)
class ChoiceUsage:
    index: int
    prompt_index: int
    prompt_len: int  # our tokenizer's count: the fallback only
    engine_prompt_tokens: int | None = None
    engine_completion_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    ids_streamed: int = 0

    def observe(self, delta: Delta) -> None:
        """Keep the last value the engine reported for each count (an abort item may lack some)."""
        self.ids_streamed += len(delta.token_ids)
        if delta.prompt_tokens is not None:
            self.engine_prompt_tokens = delta.prompt_tokens
        if delta.completion_tokens is not None:
            self.engine_completion_tokens = delta.completion_tokens
        if delta.cached_tokens is not None:
            self.cached_tokens = delta.cached_tokens
        if delta.reasoning_tokens is not None:
            self.reasoning_tokens = delta.reasoning_tokens

    @property
    def derived(self) -> bool:
        return self.engine_completion_tokens is None

    @property
    def mismatched(self) -> bool:
        return self.engine_completion_tokens is not None and self.engine_completion_tokens != self.ids_streamed

    @property
    def prompt_tokens(self) -> int:
        return self.engine_prompt_tokens if self.engine_prompt_tokens is not None else self.prompt_len

    @property
    def completion_tokens(self) -> int:
        if self.engine_completion_tokens is not None:
            return self.engine_completion_tokens
        return self.ids_streamed

    def running_usage(self) -> dict[str, Any]:
        """This choice's cumulative usage, for `continuous_usage_stats`."""
        return _usage_dict(self.prompt_tokens, self.completion_tokens, None, None)


@dataclass(frozen=True, slots=True)
class RequestUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    reasoning_tokens: int | None
    derived: bool
    mismatched_choices: int

    def as_openai(self) -> dict[str, Any]:
        return _usage_dict(self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.reasoning_tokens)


def request_usage(choices: Sequence[ChoiceUsage]) -> RequestUsage:
    """Prompt counted once per prompt (its first choice), completions summed over all choices."""
    firsts: dict[int, ChoiceUsage] = {}
    for choice in sorted(choices, key=lambda c: c.index):
        firsts.setdefault(choice.prompt_index, choice)
    cached = [c.cached_tokens for c in firsts.values() if c.cached_tokens is not None]
    reasoning = [c.reasoning_tokens for c in choices if c.reasoning_tokens is not None]
    return RequestUsage(
        prompt_tokens=sum(c.prompt_tokens for c in firsts.values()),
        completion_tokens=sum(c.completion_tokens for c in choices),
        cached_tokens=sum(cached) if cached else None,
        reasoning_tokens=sum(reasoning) if reasoning else None,
        derived=any(c.derived for c in choices),
        mismatched_choices=sum(1 for c in choices if c.mismatched),
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

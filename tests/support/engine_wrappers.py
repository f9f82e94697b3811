"""Wrappers around the real CPU engine that change only how its deltas arrive.

`Coalescing` merges consecutive deltas the way SGLang coalesces a backlog (several tokens per
item), so chunk counts and token counts differ by construction. `FailingAfter` injects an engine
fault after a number of deltas. Everything else is the real engine and the real model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tally_runtime.engine.base import Delta, EngineError, GenerationRequest


def merge(deltas: list[Delta]) -> Delta:
    last = deltas[-1]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = tuple(lp for d in deltas for lp in (d.logprobs or ()))
    return Delta(
        text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        logprobs=logprobs,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
        finish_reason=last.finish_reason,
    )


class Wrapper:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Coalescing(Wrapper):
    def __init__(self, inner: Any, size: int = 3) -> None:
        super().__init__(inner)
        self.size = size

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        pending: list[Delta] = []
        async for delta in self.inner.generate(request):
            pending.append(delta)
            if len(pending) == self.size or delta.finish_reason is not None:
                yield merge(pending)
                pending = []


class FailingAfter(Wrapper):
    error: Exception = EngineError("injected engine fault")

    def __init__(self, inner: Any, deltas: int, trigger: str) -> None:
        super().__init__(inner)
        self.deltas = deltas
        self.trigger = trigger

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        seen = 0
        async for delta in self.inner.generate(request):
            if self.trigger in self.inner.detokenize(request.prompt_ids) and seen == self.deltas:
                raise self.error
            seen += 1
            yield delta


class UsageBlind(Wrapper):
    """An engine that reports no counts at all: usage must be derived, and counted as such."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        async for delta in self.inner.generate(request):
            yield Delta(text=delta.text, token_ids=delta.token_ids, finish_reason=delta.finish_reason)



class Crashing(FailingAfter):
    """An engine failing with something other than EngineError (a bug, a lost connection) after `deltas`."""

    error = RuntimeError("unexpected engine failure")

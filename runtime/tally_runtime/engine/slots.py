"""The CPU engine's contexts (one llama.cpp context per concurrent generation), lent out by the prompt they share
most with: a request goes to the free context whose KV cache holds the longest prefix of its prompt, so a repeated
system prompt or an agent's growing conversation is computed once per context, not once per request (what SGLang's
radix cache does across requests). Among contexts that share nothing, the one free the longest goes (least
recently used: the others' caches are the likelier to be asked for again). Waiters are served first come, first
served; a waiter cancelled while it waits takes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

Context = TypeVar("Context")


def shared_prefix(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """PURE: how many leading tokens `cached` and `prompt` have in common."""
    same = 0
    for a, b in zip(cached, prompt, strict=False):
        if a != b:
            break
        same += 1
    return same


class Slots(Generic[Context]):
    """Free contexts, oldest first, and a count of them that waiters queue on."""

    def __init__(self, cached: Callable[[Context], Sequence[int]], by_prefix: bool = True) -> None:
        self._cached = cached  # the tokens a context's KV cache holds
        self.by_prefix = by_prefix  # False: the context free the longest, whatever it holds (a benchmark's baseline)
        self._free: list[Context] = []
        self._count = asyncio.Semaphore(0)

    def put(self, context: Context) -> None:
        self._free.append(context)
        self._count.release()

    async def take(self, prompt: Sequence[int]) -> Context:
        """The free context that shares the longest prefix with `prompt`, waiting for one if none is free."""
        await self._count.acquire()
        best = 0
        if self.by_prefix:
            longest = 0
            for index, context in enumerate(self._free):
                same = shared_prefix(self._cached(context), prompt)
                if same > longest:
                    best, longest = index, same
        return self._free.pop(best)

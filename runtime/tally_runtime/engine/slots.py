"""The CPU engine's contexts (one llama.cpp context per concurrent generation), lent out by the prompt they share
most with: a request goes to the free context whose KV cache holds the longest prefix of its prompt, so a repeated
system prompt or an agent's growing conversation is computed once per context, not once per request (what SGLang's
radix cache does across requests), unless that costs more cache than it saves: a context is chosen by what the
request must compute there plus what of its cache is lost (`len(prompt) + held - 2 x shared`, the least), so a
prompt that shares only a few opening words with a context's system prompt does not overwrite it while a context
holding little is free. Among equals, the one free the longest goes (least recently used). Waiters are served
first come, first served; a waiter cancelled while it waits takes nothing."""

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
        """The free context where `prompt` costs least (computed, plus cache lost), waiting if none is free."""
        await self._count.acquire()
        best = 0
        if self.by_prefix:
            least = None
            for index, context in enumerate(self._free):
                held = self._cached(context)
                cost = len(held) - 2 * shared_prefix(held, prompt)  # + len(prompt), the same for every context
                if least is None or cost < least:
                    best, least = index, cost
        return self._free.pop(best)

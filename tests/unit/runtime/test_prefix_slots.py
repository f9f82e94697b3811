"""The CPU engine lends a request the context whose KV cache holds the longest prefix of its prompt (issue 62,
item 7: three identical requests got `cached_tokens` 7, 7, 255: the discount and the compute depended on which
context a request happened to land in). The pool alone, and the real engine over the embedded model."""

from __future__ import annotations

import asyncio

import pytest

from tally_runtime.engine.base import GenerationRequest, SamplingParams
from tally_runtime.engine.llamacpp import LlamaCppEngine, embedded_model_path
from tally_runtime.engine.slots import Slots, shared_prefix


def test_shared_prefix_counts_leading_tokens_in_common() -> None:
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([], [1]) == 0 and shared_prefix([1, 2], [1, 2]) == 2 and shared_prefix([9], [1]) == 0


async def test_the_cheapest_context_wins_ties_go_to_the_one_free_the_longest_and_waiters_keep_their_turn() -> None:
    """Cost: what the request computes there plus what of the context's cache it overwrites."""
    slots: Slots[tuple[int, ...]] = Slots(lambda cached: cached)
    system = tuple(range(100, 140))
    for context in [(1, 2), (*system, 7, 7), (8, 9), system[:3]]:
        slots.put(context)
    assert await slots.take([*system, 5]) == (*system, 7, 7)  # its whole system prompt is there
    assert await slots.take([*system[:3], 50, 51]) == system[:3]  # shares a little with what holds little
    assert await slots.take([3]) == (1, 2)  # nothing shared, equal cost: the one free the longest
    assert await slots.take([3]) == (8, 9)
    slots.put((*system, 7))
    slots.put((42,))
    # a prompt that shares only the opening words of a held system prompt does not overwrite it
    assert await slots.take([*system[:3], 60, 61, 62]) == (42,)
    assert await slots.take([1]) == (*system, 7)
    first = asyncio.create_task(slots.take([1]))
    gone = asyncio.create_task(slots.take([1]))
    last = asyncio.create_task(slots.take([1]))
    await asyncio.sleep(0)  # all three wait (nothing free): one loop turn, no timing
    gone.cancel()
    slots.put((1, 1))
    slots.put((2, 2))
    assert await asyncio.wait_for(first, 5) == (1, 1) and await asyncio.wait_for(last, 5) == (2, 2)
    assert gone.cancelled()


@pytest.mark.parametrize("by_prefix", [True, False], ids=["by-prefix", "oldest-free"])
async def test_a_repeated_system_prompt_is_taken_from_the_cache_whichever_context_is_free_first(
        by_prefix: bool) -> None:
    engine = LlamaCppEngine(embedded_model_path(), context_length=512, slots=2, threads=1, by_prefix=by_prefix)
    await engine.start()
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        systems = ["You are a terse assistant for a shipping company. Answer in one line. " * 3,
                   "Eres un asistente de cocina que responde en castellano con recetas breves. " * 3]

        async def cached(system: str, question: str) -> int:
            prompt = engine.tokenize(system + question)
            last = None
            async for delta in engine.generate(GenerationRequest(f"r-{len(question)}-{system[:3]}", prompt, params)):
                last = delta
            assert last is not None and last.cached_tokens is not None
            return last.cached_tokens

        await cached(systems[0], "Where is my parcel?")  # the first context holds the first system prompt
        await cached(systems[1], "¿Qué cocino hoy?")  # the second context the second
        again = await cached(systems[1], "¿Y mañana?")  # the first context is the one free the longest
        shared = shared_prefix(engine.tokenize(systems[1] + "¿Qué cocino hoy?"), engine.tokenize(systems[1] + "¿Y"))
        if by_prefix:
            assert again >= shared - 1 > 30, (again, shared)
        else:  # the baseline (benchmarks/prefix_slots.py): the cache of the wrong context
            assert again <= 2, again
    finally:
        await engine.stop()

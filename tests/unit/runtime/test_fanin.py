"""merge_choices: every choice's deltas in order, batched when the consumer lags, errors after what preceded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from tally_runtime.engine.base import Delta, EngineError, FinishReason, GenerationRequest, SamplingParams
from tally_runtime.fanin import merge_choices


class ScriptedEngine:
    """Per request id: the deltas to yield, an exception to raise after them, or an early end."""

    def __init__(self, scripts: dict[str, tuple[list[Delta], Exception | None]]) -> None:
        self.scripts = scripts
        self.closed: list[str] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        deltas, error = self.scripts[request.request_id]
        try:
            for delta in deltas:
                yield delta
                await asyncio.sleep(0)
            if error is not None:
                raise error
        finally:
            self.closed.append(request.request_id)


def tokens(count: int, finish: bool = True) -> list[Delta]:
    return [Delta(text=f"t{i}", token_ids=(i,), completion_tokens=i + 1,
                  finish_reason=FinishReason.LENGTH if finish and i == count - 1 else None) for i in range(count)]


def requests(*ids: str) -> Sequence[GenerationRequest]:
    return [GenerationRequest(i, (1,), SamplingParams(max_tokens=8)) for i in ids]


async def drain(stream: AsyncIterator[list[tuple[int, Delta]]], lag: bool = False) -> list[list[tuple[int, Delta]]]:
    batches = []
    async for batch in stream:
        batches.append(batch)
        if lag:  # a slow client: the producers run ahead meanwhile
            for _ in range(5):
                await asyncio.sleep(0)
    return batches


@pytest.mark.parametrize("lag", [False, True])
async def test_every_choice_in_order_and_a_lagging_consumer_gets_batches(lag: bool) -> None:
    engine = ScriptedEngine({"a": (tokens(20), None), "b": (tokens(13), None)})
    batches = await drain(merge_choices(engine, requests("a", "b")), lag=lag)  # type: ignore[arg-type]
    flat = [item for batch in batches for item in batch]
    for index, count in ((0, 20), (1, 13)):
        assert [d.text for i, d in flat if i == index] == [f"t{k}" for k in range(count)]
    assert (max(len(b) for b in batches) > 2) is lag


async def test_an_error_ends_the_stream_after_the_deltas_before_it_and_aborts_the_rest() -> None:
    engine = ScriptedEngine({"a": (tokens(3, finish=False), EngineError("boom", 503)), "b": (tokens(50), None)})
    seen: list[tuple[int, Delta]] = []
    with pytest.raises(EngineError, match="boom"):
        async for batch in merge_choices(engine, requests("a", "b")):  # type: ignore[arg-type]
            seen.extend(batch)
    assert [d.text for i, d in seen if i == 0] == ["t0", "t1", "t2"]
    assert len([d for i, d in seen if i == 1]) < 50
    assert sorted(engine.closed) == ["a", "b"]  # the other choice was aborted


async def test_a_generation_that_ends_without_a_finish_reason_is_an_engine_error() -> None:
    engine = ScriptedEngine({"a": (tokens(4, finish=False), None)})
    with pytest.raises(EngineError, match="without a finish reason"):
        await drain(merge_choices(engine, requests("a")))  # type: ignore[arg-type]


async def test_closing_early_aborts_every_choice() -> None:
    engine = ScriptedEngine({"a": (tokens(100), None), "b": (tokens(100), None)})
    stream: Any = merge_choices(engine, requests("a", "b"))  # type: ignore[arg-type]
    await anext(stream)
    await stream.aclose()
    assert sorted(engine.closed) == ["a", "b"]

"""Choices: every choice's deltas in order, batched when the consumer lags, errors after what preceded;
ending early aborts in the engine and waits, bounded, for the engine's final counts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from tally_runtime.engine.base import (
    Delta,
    EngineError,
    FinishReason,
    GenerationRequest,
    ItemStream,
    SamplingParams,
)
from tally_runtime.fanin import Batch, Choices


class ScriptedEngine:
    """Per request id: the deltas to yield, an exception to raise after them. `abort` makes a running
    generation end at its next step with an ABORT delta counting what it generated; `deaf` ignores it."""

    def __init__(self, scripts: dict[str, tuple[list[Delta], Exception | None]], deaf: bool = False) -> None:
        self.scripts = scripts
        self.deaf = deaf
        self.closed: list[str] = []
        self.started: list[str] = []
        self.aborted: set[str] = set()

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        self.started.append(request.request_id)
        deltas, error = self.scripts[request.request_id]
        try:
            for count, delta in enumerate(deltas):
                if request.request_id in self.aborted and not self.deaf:
                    yield Delta(token_ids=(99,), completion_tokens=count + 1, finish_reason=FinishReason.ABORT)
                    return
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


async def drain(stream: AsyncIterator[Batch], lag: bool = False) -> list[Batch]:
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
    batches = await drain(Choices(engine, requests("a", "b")).batches(), lag=lag)  # type: ignore[arg-type]
    flat = [item for batch in batches for item in batch]
    for index, count in ((0, 20), (1, 13)):
        assert [d.text for i, d in flat if i == index] == [f"t{k}" for k in range(count)]
    assert (max(len(b) for b in batches) > 2) is lag


async def test_an_error_ends_the_stream_after_the_deltas_before_it() -> None:
    engine = ScriptedEngine({"a": (tokens(3, finish=False), EngineError("boom", 503)), "b": (tokens(50), None)})
    choices = Choices(engine, requests("a", "b"))  # type: ignore[arg-type]
    seen: list[tuple[int, Delta]] = []
    with pytest.raises(EngineError, match="boom"):
        async for batch in choices.batches():
            seen.extend(batch)
    assert [d.text for i, d in seen if i == 0] == ["t0", "t1", "t2"]
    assert len([d for i, d in seen if i == 1]) < 50
    await choices.cancel()
    assert sorted(engine.closed) == ["a", "b"]


async def test_a_generation_that_ends_without_a_finish_reason_is_an_engine_error() -> None:
    engine = ScriptedEngine({"a": (tokens(4, finish=False), None)})
    with pytest.raises(EngineError, match="without a finish reason"):
        await drain(Choices(engine, requests("a")).batches())  # type: ignore[arg-type]


async def test_aborting_returns_the_engines_final_counts_of_every_unfinished_choice() -> None:
    engine = ScriptedEngine({"a": (tokens(100), None), "b": (tokens(100), None), "done": (tokens(1), None)})
    choices = Choices(engine, requests("a", "b", "done"))  # type: ignore[arg-type]
    stream = choices.batches()
    first = await anext(stream)
    await stream.aclose()
    late = await choices.abort(settle_seconds=5)
    finals = {i: d for i, d in [*first, *late] if d.finish_reason == FinishReason.ABORT}
    assert sorted(finals) == [0, 1] and all(d.completion_tokens for d in finals.values())
    assert engine.aborted == {"a", "b"}  # the finished choice was not aborted
    assert sorted(engine.closed) == ["a", "b", "done"]


async def test_a_choice_aborted_before_it_reached_the_engine_never_starts() -> None:
    engine = ScriptedEngine({"a": (tokens(5), None)})
    choices = Choices(engine, requests("a"))  # type: ignore[arg-type]
    late = await choices.abort(settle_seconds=5)  # in the same loop turn: its task has not run yet
    assert late == [] and engine.started == []


async def test_an_engine_that_ignores_the_abort_is_cancelled_after_the_bound() -> None:
    engine = ScriptedEngine({"a": (tokens(100_000), None)}, deaf=True)
    choices = Choices(engine, requests("a"))  # type: ignore[arg-type]
    await anext(choices.batches())
    late = await choices.abort(settle_seconds=0.05)
    assert all(d.finish_reason is None for _, d in late) and engine.closed == ["a"]


# ---- an engine whose generations are ItemStreams: the pump reads the items and converts them itself


class CountingItems(ItemStream):
    """Items are counts 1..`count`; the last finishes. Raises `error` after `fail_after` items. Records its
    calls, so a test sees the order of open, first_item, convert and close."""

    def __init__(self, count: int, error: Exception | None = None, fail_after: int = 0) -> None:
        self.count, self.error, self.fail_after = count, error, fail_after
        self.calls: list[str] = []
        self.convert = self._convert

    async def open(self) -> AsyncIterator[Any]:
        self.calls.append("open")
        return self._items()

    async def _items(self) -> AsyncIterator[int]:
        for n in range(1, self.count + 1):
            if self.error is not None and n > self.fail_after:
                raise self.error
            yield n
            await asyncio.sleep(0)

    def _convert(self, n: int) -> Delta:
        self.calls.append(f"convert {n}")
        return Delta(text=f"t{n}", token_ids=(n,), completion_tokens=n,
                     finish_reason=FinishReason.LENGTH if n == self.count else None)

    def first_item(self) -> None:
        self.calls.append("first")

    def failed(self, error: Exception, started: bool) -> Exception:
        return EngineError(f"mapped {type(error).__name__} started={started}", 502)

    async def close(self, finished: bool) -> None:
        self.calls.append(f"close finished={finished}")


class ItemsEngine:
    def __init__(self, **streams: CountingItems) -> None:
        self.streams = streams
        self.aborted: set[str] = set()

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def generate(self, request: GenerationRequest) -> ItemStream:
        return self.streams[request.request_id]


async def read_directly(stream: CountingItems) -> tuple[list[Delta], Exception | None]:
    out: list[Delta] = []
    try:
        async for delta in stream:
            out.append(delta)
    except EngineError as err:
        return out, err
    return out, None


async def read_through_the_pump(stream: CountingItems) -> tuple[list[Delta], Exception | None]:
    out: list[Delta] = []
    try:
        async for batch in Choices(ItemsEngine(a=stream), requests("a")).batches():  # type: ignore[arg-type]
            out.extend(d for _, d in batch)
    except EngineError as err:
        return out, err
    return out, None


@pytest.mark.parametrize("read", [read_directly, read_through_the_pump])
async def test_an_item_stream_is_converted_item_by_item_and_closed_as_finished(read: Any) -> None:
    stream = CountingItems(3)
    deltas, error = await read(stream)
    assert error is None and [d.text for d in deltas] == ["t1", "t2", "t3"]
    assert stream.calls == ["open", "first", "convert 1", "convert 2", "convert 3", "close finished=True"]


@pytest.mark.parametrize("read", [read_directly, read_through_the_pump])
@pytest.mark.parametrize(("fail_after", "started"), [(0, False), (2, True)])
async def test_an_item_streams_error_is_what_the_adapter_makes_of_it(read: Any, fail_after: int,
                                                                      started: bool) -> None:
    stream = CountingItems(5, ValueError("engine says no"), fail_after)
    deltas, error = await read(stream)
    assert [d.text for d in deltas] == [f"t{n}" for n in range(1, fail_after + 1)]
    assert isinstance(error, EngineError) and error.message == f"mapped ValueError started={started}"
    assert stream.calls[-1] == "close finished=False"  # not finished: the adapter aborts it in the engine


async def test_an_item_stream_cancelled_mid_way_is_closed_unfinished() -> None:
    stream = CountingItems(1000)
    choices = Choices(ItemsEngine(a=stream), requests("a"))  # type: ignore[arg-type]
    await anext(choices.batches())
    await choices.cancel()
    assert stream.calls[:2] == ["open", "first"] and stream.calls[-1] == "close finished=False"
    assert stream.calls.count("first") == 1

"""The fake itself obeys SGLANG_CONTRACT.md §1-§3, so a wrong fake cannot make the adapter look right."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Any

import pytest
import sglang
from fake_sglang import GENERATIONS
from sglang.srt import server_args

PROMPT_TEXT = "The quick brown fox"


def field_for(gen: str) -> str:
    return "stream_output" if gen in "AB" else "incremental_streaming_output"


def run(gen: str, incremental: bool, coalesce: tuple[int, ...] = (1,), **params: Any) -> list[dict[str, Any]]:
    sglang.configure(version=GENERATIONS[gen], coalesce=coalesce)
    engine = sglang.Engine(model_path="m", **{field_for(gen): incremental})

    async def go() -> list[dict[str, Any]]:
        ids = engine.tokenizer_manager.tokenizer.encode(PROMPT_TEXT)
        gen_ = await engine.async_generate(input_ids=ids, sampling_params={"temperature": 0, **params}, stream=True)
        items = []
        async for item in gen_:  # snapshot: cumulative mode hands out a live list
            items.append({**item, "output_ids": list(item["output_ids"])})
        return items

    try:
        return asyncio.run(go())
    finally:
        engine.shutdown()


CASES = [pytest.param(g, inc, c, id=f"{g}-{'inc' if inc else 'cum'}-{''.join(map(str, c))}")
         for g in "ABCD" for inc in (True, False) for c in ((1,), (3,))]


@pytest.mark.parametrize(("gen", "incremental", "coalesce"), CASES)
def test_invariants(gen: str, incremental: bool, coalesce: tuple[int, ...]) -> None:
    items = run(gen, incremental, coalesce, max_new_tokens=9, ignore_eos=True)
    final = items[-1]["meta_info"]
    assert final["completion_tokens"] == 9 and final["finish_reason"] == {"type": "length", "length": 9}
    counts = [i["meta_info"]["completion_tokens"] for i in items]
    assert counts == sorted(counts)
    ids_delta = (gen == "A") or (incremental and gen in "BCD")
    text_delta = incremental and gen in "CD"
    if ids_delta and (gen in "CD" or coalesce == (1,)):
        assert sum(len(i["output_ids"]) for i in items) == final["completion_tokens"]
    if ids_delta and gen in "AB" and coalesce == (3,):  # ≤0.5.9 keeps only the last output: ids are lost
        assert sum(len(i["output_ids"]) for i in items) < final["completion_tokens"]
    if not ids_delta:
        assert all(len(i["output_ids"]) == i["meta_info"]["completion_tokens"] for i in items)
    texts = [i["text"] for i in items]
    if text_delta:
        nonempty = [t for t in texts if t]
        assert not all(b.startswith(a) for a, b in itertools.pairwise(nonempty))  # deltas, not a growing text
    else:
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    if gen in "CD" and incremental and coalesce == (3,):
        assert max(len(i["output_ids"]) for i in items) == 3


def test_incremental_text_joins_to_cumulative_text() -> None:
    deltas = run("D", True, (1, 4, 2), max_new_tokens=12, ignore_eos=True)
    whole = run("D", False, (1,), max_new_tokens=12, ignore_eos=True)
    assert "".join(i["text"] for i in deltas) == whole[-1]["text"]


def test_class_shapes_per_generation() -> None:
    for gen, version in GENERATIONS.items():
        sglang.configure(version=version)
        cls = server_args.ServerArgs
        if gen == "D":
            assert "incremental_streaming_output" in cls.__struct_fields__
            assert not hasattr(cls, "__dataclass_fields__")
        else:
            assert dataclasses.is_dataclass(cls)
            assert field_for(gen) in cls.__dataclass_fields__
        other = "stream_output" if field_for(gen) != "stream_output" else "incremental_streaming_output"
        with pytest.raises(TypeError):
            cls(model_path="m", **{other: True})


def test_renamed_field_assignment_is_silently_ignored_then_sealed() -> None:
    sglang.configure(version=GENERATIONS["C"])
    args = server_args.ServerArgs(model_path="m")
    args.stream_output = True  # the no-op that broke downstream projects
    assert args.incremental_streaming_output is False
    sglang.configure(version=GENERATIONS["D"])
    sealed = server_args.ServerArgs(model_path="m")
    sealed.resolve_once()
    with pytest.raises(AttributeError):
        sealed.incremental_streaming_output = True


def test_eos_only_final_item_and_stop_trim() -> None:
    items = run("D", True, (1,), max_new_tokens=40, stop=["."])
    final = items[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "stop"
    assert "." not in "".join(i["text"] for i in items)
    assert sum(len(i["output_ids"]) for i in items) == final["meta_info"]["completion_tokens"]


def test_waiting_queue_abort_shape() -> None:
    sglang.configure(version=GENERATIONS["D"], aborts={"quick": (3, "waiting")})
    engine = sglang.Engine(model_path="m", incremental_streaming_output=True)

    async def go() -> list[dict[str, Any]]:
        ids = engine.tokenizer_manager.tokenizer.encode(PROMPT_TEXT)
        return [dict(i) async for i in await engine.async_generate(
            input_ids=ids, sampling_params={"max_new_tokens": 9, "temperature": 0}, stream=True)]

    items = asyncio.run(go())
    last = items[-1]
    assert "prompt_tokens" not in last["meta_info"]
    assert last["text"] == "".join(i["text"] for i in items[:-1]) or last["text"].startswith(items[0]["text"])
    assert last["output_ids"] == items[-2]["output_ids"][-1:]  # the duplicated last id


def test_value_error_on_first_iteration() -> None:
    sglang.configure(version=GENERATIONS["D"], context_len=64)
    engine = sglang.Engine(model_path="m", incremental_streaming_output=True)

    async def go() -> None:
        gen = await engine.async_generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 100}, stream=True)
        with pytest.raises(ValueError, match="maximum context length"):
            await gen.__anext__()

    asyncio.run(go())


@pytest.mark.parametrize("gen", ["C", "D"])
@pytest.mark.parametrize("abort_after", [None, 5])
@pytest.mark.parametrize("close_after", [None, 3])
def test_the_zero_cost_stream_is_the_general_path_in_one_generator(gen: str, abort_after: int | None,
                                                                   close_after: int | None) -> None:
    """benchmarks/relay.py's adapter path reads `_zero_cost_stream`: the same items and the same books (what
    finished, was aborted, or left running for nobody) as `_stream` over `_zero_cost_steps` gives."""
    sglang.configure(version=GENERATIONS[gen], zero_cost=True)

    async def read(one_generator: bool) -> tuple[list[dict[str, Any]], tuple[list[str], list[str], list[str]]]:
        engine = sglang.Engine(model_path="m", incremental_streaming_output=True)
        tm = engine.tokenizer_manager
        ids, params = [7, 7], {"max_new_tokens": 12}
        stream = (engine._zero_cost_stream(ids, params, "r.") if one_generator
                  else engine._stream(ids, params, False, 0, "r."))
        items = []
        async for item in stream:
            items.append(item)
            if len(items) == abort_after:
                tm.abort_request("r.")
            if len(items) == close_after:
                await stream.aclose()
                break
        engine.shutdown()
        return items, (tm.finished, tm.aborted, tm.ghosts)

    try:
        general, fast = asyncio.run(read(False)), asyncio.run(read(True))
    finally:
        sglang.configure()
    assert fast == general
    assert fast[0]  # and it streamed something
    ended = {"finished": bool(fast[1][0]), "aborted": bool(fast[1][1]), "ghosts": bool(fast[1][2])}
    if close_after:
        assert ended == {"finished": False, "aborted": gen == "D", "ghosts": gen == "C"}
    else:
        assert ended == {"finished": abort_after is None, "aborted": abort_after is not None, "ghosts": False}


def test_the_adapter_reads_the_zero_cost_stream_when_it_applies() -> None:
    sglang.configure(version=GENERATIONS["D"], zero_cost=True)
    engine = sglang.Engine(model_path="m", incremental_streaming_output=True)

    async def kinds() -> tuple[str, str]:
        plain = await engine.async_generate(input_ids=[7], sampling_params={"max_new_tokens": 2}, stream=True)
        logprobs = await engine.async_generate(input_ids=[7], sampling_params={"max_new_tokens": 2}, stream=True,
                                               return_logprob=True)
        names = plain.__qualname__, logprobs.__qualname__  # type: ignore[attr-defined]
        await plain.aclose()
        await logprobs.aclose()
        return names

    try:
        assert asyncio.run(kinds()) == ("Engine._zero_cost_stream", "Engine._stream")
    finally:
        engine.shutdown()
        sglang.configure()

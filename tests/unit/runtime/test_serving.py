"""The serving core on a scripted engine: what each chunk says, what gets recorded, and when.

The engine here only decides *when* deltas arrive (a whole backlog at once, a choice stuck in prefill,
a refusal before the first token); `Server`, `Run`, the renderer and the metrics are the real ones."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from scripted_engine import INFO, Script, ScriptedEngine, tokens

from tally_runtime.auth import Tenant
from tally_runtime.engine.base import (
    Delta,
    EngineError,
    FinishReason,
    InvalidRequestError,
)
from tally_runtime.metrics import Metrics
from tally_runtime.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from tally_runtime.serving import Server

TENANT = Tenant("t", "header")


def server(script: Script, limit: int = 4) -> Server:
    return Server(ScriptedEngine(script), INFO, "m", Metrics(), limit)


def events(chunks: list[bytes]) -> list[Any]:
    body = b"".join(chunks)
    return [e[6:].decode() if e == b"data: [DONE]" else orjson.loads(e[6:]) for e in body.split(b"\n\n") if e]


async def stream(srv: Server, body: dict[str, Any], chat: bool = False, take: int | None = None) -> list[Any]:
    job = await (srv.prepare.chat(ChatCompletionRequest(**body)) if chat else srv.prepare.completion(
        CompletionRequest(**body)))
    run = await srv.start(job, TENANT)
    out: list[bytes] = []
    body_iter = run.stream()
    async for chunk in body_iter:
        out.append(chunk)
        if take is not None and len(out) >= take:
            await body_iter.aclose()  # type: ignore[attr-defined]
            break
    return events(out)


STREAM = {"prompt": "a b c", "max_tokens": 4, "stream": True}


RUNNING = {"include_usage": True, "continuous_usage_stats": True}


def counter(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    total = 0.0
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def test_running_usage_is_per_chunk_even_when_a_backlog_arrives_as_one_batch() -> None:
    srv = server(Script({0: tokens(4)}))  # all four deltas are waiting when the stream is first read
    got = asyncio.run(stream(srv, {**STREAM, "stream_options": RUNNING}))
    counts = [e["usage"]["completion_tokens"] for e in got if isinstance(e, dict) and e["choices"]]
    assert counts == [1, 2, 3, 4]


def test_chat_role_chunk_reports_no_completion_tokens() -> None:
    srv = server(Script({0: tokens(2)}))
    got = asyncio.run(stream(srv, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                   "stream": True, "stream_options": RUNNING}, chat=True))
    role = got[0]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["usage"]["completion_tokens"] == 0 and role["usage"]["total_tokens"] == role["usage"]["prompt_tokens"]
    assert [e["usage"]["completion_tokens"] for e in got[1:3]] == [1, 2]


def test_a_choice_first_batch_is_not_inter_token_latency() -> None:
    """Three tokens arrive together after prefill: their wait is time to first token, not ITL."""
    srv = server(Script({0: tokens(3)}))
    asyncio.run(stream(srv, STREAM))
    assert counter(srv.metrics, "tally_inter_token_latency_seconds_count") == 0
    assert counter(srv.metrics, "tally_time_to_first_token_seconds_count") == 1


def test_n2_closed_while_a_choice_is_in_prefill_bills_only_what_the_engine_reported() -> None:
    srv = server(Script({0: tokens(4, prompt=3, finish=False)}, stall={1}))
    asyncio.run(stream(srv, {**STREAM, "n": 2}, take=1))
    m = srv.metrics
    assert counter(m, "tally_requests_total", {"outcome": "aborted"}) == 1
    assert counter(m, "tally_derived_usage_requests_total") == 0
    assert counter(m, "tally_prompt_tokens_total") == 3  # the engine's count for that prompt, not ours
    assert counter(m, "tally_completion_tokens_total") >= 1
    assert srv.admission.idle


def test_n2_with_one_choice_failing_is_not_derived() -> None:
    srv = server(Script({0: tokens(1, finish=False), 1: []}, error={1: EngineError("boom")}))
    got = asyncio.run(stream(srv, {**STREAM, "n": 2}))
    assert any(isinstance(e, dict) and "error" in e for e in got) and got[-1] == "[DONE]"
    m = srv.metrics
    assert counter(m, "tally_requests_total", {"outcome": "error"}) == 1
    assert counter(m, "tally_derived_usage_requests_total") == 0


@pytest.mark.parametrize(("error", "status"), [
    pytest.param(InvalidRequestError("top_k must be -1 (disable) or at least 1, got 0."), 400, id="refused"),
    pytest.param(EngineError("Request running timeout reached.", 503), 503, id="engine-busy"),
    pytest.param(RuntimeError("unexpected"), 500, id="unexpected"),
])
def test_a_refusal_before_the_first_token_is_recorded_once_and_unbilled(error: Exception, status: int) -> None:
    srv = server(Script({0: []}, error={0: error}))

    async def scenario() -> ApiError:
        job = await srv.prepare.completion(CompletionRequest(**STREAM))
        with pytest.raises(ApiError) as caught:
            await srv.start(job, TENANT)
        assert caught.value.recorded  # so the route does not record it again
        return caught.value

    refused = asyncio.run(scenario())
    assert refused.status == status
    if status == 503:
        assert refused.headers.get("Retry-After")
    m = srv.metrics
    assert counter(m, "tally_requests_total") == 1  # once, not also as "aborted"
    assert counter(m, "tally_prompt_tokens_total") == 0 and counter(m, "tally_completion_tokens_total") == 0
    assert counter(m, "tally_derived_usage_requests_total") == 0
    assert srv.admission.idle


def test_requests_beyond_the_limit_queue_and_all_finish() -> None:
    gate = asyncio.Event()
    srv = server(Script({0: tokens(2)}, gate=gate), limit=1)

    async def scenario() -> list[list[Any]]:
        tasks = [asyncio.create_task(stream(srv, STREAM)) for _ in range(3)]
        for _ in range(10):
            await asyncio.sleep(0)
        assert srv.admission.queued == 2 and counter(srv.metrics, "tally_queued_requests") == 2
        gate.set()
        return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    assert all(r[-1] == "[DONE]" for r in results)
    assert counter(srv.metrics, "tally_requests_total", {"outcome": "ok"}) == 3
    assert counter(srv.metrics, "tally_queue_time_seconds_count") == 3


def test_a_draining_server_refuses_new_requests_with_retry_after() -> None:
    srv = server(Script({0: tokens(1)}))
    srv.draining = True
    async def scenario() -> None:
        await srv.start(await srv.prepare.completion(CompletionRequest(**STREAM)), TENANT)

    with pytest.raises(ApiError) as caught:
        asyncio.run(scenario())
    assert caught.value.status == 503 and caught.value.headers["Retry-After"]


def test_an_abort_among_other_choices_in_one_batch_skips_none_of_their_counts() -> None:
    """Choice 0's engine aborts while choice 1 finishes; both arrive in the same batch."""
    gate = asyncio.Event()
    abort = Delta(token_ids=(5,), prompt_tokens=3, completion_tokens=2, finish_reason=FinishReason.ABORT)
    srv = server(Script({0: [*tokens(1, finish=False), abort], 1: tokens(2)}, gate=gate))

    async def scenario() -> list[Any]:
        job = await srv.prepare.completion(CompletionRequest(**{**STREAM, "n": 2}))
        starting = asyncio.create_task(srv.start(job, TENANT))
        for _ in range(5):
            await asyncio.sleep(0)
        gate.set()
        run = await starting
        return events([chunk async for chunk in run.stream()])

    got = asyncio.run(scenario())
    assert any(isinstance(e, dict) and "error" in e for e in got) and got[-1] == "[DONE]"
    assert [c["choices"][0]["finish_reason"] for c in got if isinstance(c, dict) and c.get("choices")
            and c["choices"][0]["index"] == 1][-1] == "length"  # choice 1's own chunks went out
    assert counter(srv.metrics, "tally_completion_tokens_total") == 2 + 2  # both choices' final counts
    assert counter(srv.metrics, "tally_usage_mismatches_total") == 0


def test_a_client_that_leaves_mid_stream_is_billed_what_the_engine_generated() -> None:
    srv = server(Script({0: tokens(50)}, paced=True))
    got = asyncio.run(stream(srv, STREAM | {"max_tokens": 50}, take=3))
    streamed = sum(1 for e in got if isinstance(e, dict) and e.get("choices"))
    assert streamed == 3
    assert counter(srv.metrics, "tally_requests_total", {"outcome": "aborted"}) == 1
    billed = counter(srv.metrics, "tally_completion_tokens_total")
    assert streamed < billed < 50  # one past what was read: the engine generated it before the abort landed
    assert counter(srv.metrics, "tally_usage_mismatches_total") == 0
    assert srv.admission.idle and not srv.runs and not srv.closing


def test_a_client_that_leaves_while_queued_is_recorded_once_and_unbilled() -> None:
    gate = asyncio.Event()
    srv = server(Script({0: tokens(2)}, gate=gate), limit=1)

    async def scenario() -> None:
        job = await srv.prepare.completion(CompletionRequest(**STREAM))
        holder = asyncio.create_task(srv.start(job, TENANT))
        for _ in range(5):
            await asyncio.sleep(0)
        queued = asyncio.create_task(srv.start(await srv.prepare.completion(CompletionRequest(**STREAM)), TENANT))
        for _ in range(5):
            await asyncio.sleep(0)
        assert srv.admission.queued == 1
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.set()
        run = await holder
        [chunk async for chunk in run.stream()]

    asyncio.run(scenario())
    assert counter(srv.metrics, "tally_requests_total", {"outcome": "aborted"}) == 1
    assert counter(srv.metrics, "tally_requests_total", {"outcome": "ok"}) == 1
    assert srv.admission.idle


def test_a_client_that_leaves_in_prefill_is_recorded_once_by_its_run() -> None:
    srv = server(Script({}, stall={0}))

    async def scenario() -> None:
        starting = asyncio.create_task(srv.start(await srv.prepare.completion(CompletionRequest(**STREAM)), TENANT))
        for _ in range(5):
            await asyncio.sleep(0)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        await srv.settle()

    asyncio.run(scenario())
    assert counter(srv.metrics, "tally_requests_total") == 1
    assert counter(srv.metrics, "tally_requests_total", {"outcome": "aborted"}) == 1
    assert counter(srv.metrics, "tally_prompt_tokens_total") == 0  # the engine never reported on it
    assert srv.admission.idle

"""The SGLang adapter against the contract fake: every generation x mode x coalescing pattern.

The client must see the same text and usage streamed and non-streamed, usage from meta_info, and the
known failure (cumulative output relayed as deltas) must never reach a client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sglang
from fake_sglang import GENERATIONS
from runtime_harness import metric_value, serving, sse_payloads

from tally_runtime.app import create_app
from tally_runtime.engine.base import Delta, FinishReason, GenerationRequest, InvalidRequestError, SamplingParams
from tally_runtime.engine.sglang import SGLangEngine
from tally_runtime.fanin import Choices
from tally_runtime.settings import Settings

BODY = {"prompt": "The capital of France is", "max_tokens": 10, "temperature": 0, "ignore_eos": True}


def settings(**changes: Any) -> Settings:
    return Settings(engine="sglang", model_path="/models/fake", **changes)


@pytest.fixture(params=[pytest.param((g, c), id=f"{g}-{''.join(map(str, c))}")
                        for g in "ABCD" for c in ((1,), (3,), (1, 4, 2))])
def adapter_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    gen, coalesce = request.param
    sglang.configure(version=GENERATIONS[gen], coalesce=coalesce)
    with serving(create_app(settings(), SGLangEngine(settings().engine_config()))) as url:
        yield url, gen, coalesce


def test_stream_equals_non_stream_with_engine_usage(adapter_url: tuple[str, str, tuple[int, ...]]) -> None:
    url, _, _ = adapter_url
    assert httpx.get(f"{url}/health").status_code == 200
    plain = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()
    response = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={**BODY, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_payloads(response.content)
    text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])
    assert text == plain["choices"][0]["text"] and text
    assert "ThreeThree" not in text
    streamed = events[-2]["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert streamed[key] == plain["usage"][key]
    # the same prompt again is a prefix-cache hit, reported as OpenAI's cached_tokens (T36)
    assert 0 < streamed["prompt_tokens_details"]["cached_tokens"] <= streamed["prompt_tokens"]
    assert plain["usage"]["completion_tokens"] == 10  # from meta_info: never triangular, never a chunk count
    metrics = httpx.get(f"{url}/metrics").text
    assert metric_value(metrics, "tally_stream_mode", {"mode": "incremental"}) == 1
    # ≤0.5.9 drops coalesced delta ids (§3): usage is still right, and that known loss is no mismatch
    assert metric_value(metrics, "tally_usage_mismatches_total") == 0


def test_chat_and_n2_through_the_adapter(adapter_url: tuple[str, str, tuple[int, ...]]) -> None:
    url, _, _ = adapter_url
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "stream": True})
    events = sse_payloads(chat.content)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[-1] == "[DONE]"
    two = httpx.post(f"{url}/v1/completions", json={**BODY, "n": 2, "max_tokens": 4}, timeout=60).json()
    assert sorted(c["index"] for c in two["choices"]) == [0, 1]
    assert two["usage"]["completion_tokens"] == 8


class SwitchIgnored(SGLangEngine):
    """An SGLang whose streaming switch did not take effect, as an attribute assignment would have done."""

    async def start(self) -> Any:
        original = sglang.Engine.__init__

        def init(engine: Any, **kwargs: Any) -> None:
            field = next(k for k in ("incremental_streaming_output", "stream_output") if k in kwargs)
            original(engine, **{**kwargs, field: False})

        sglang.Engine.__init__ = init  # type: ignore[method-assign]
        try:
            return await super().start()
        finally:
            sglang.Engine.__init__ = original  # type: ignore[method-assign]


@pytest.mark.parametrize("gen", ["A", "B", "C", "D"])
def test_cumulative_engine_is_refused_unless_allowed(gen: str) -> None:
    sglang.configure(version=GENERATIONS[gen], coalesce=(1, 3))
    with serving(create_app(settings(), SwitchIgnored(settings().engine_config())), health=503) as url:
        reason = httpx.get(f"{url}/health").json()["reason"]
        assert "incremental streaming off" in reason
        plain = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()
        assert plain["usage"]["completion_tokens"] == 10  # deltas and usage still correct
        events = sse_payloads(httpx.post(f"{url}/v1/completions", json={**BODY, "stream": True}, timeout=60).content)
        text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])
        assert text == plain["choices"][0]["text"]
    allowed = settings(allow_cumulative_stream=True)
    with serving(create_app(allowed, SwitchIgnored(allowed.engine_config()))) as url:
        metrics = httpx.get(f"{url}/metrics").text
        # the switch is off, so the mode in force is cumulative (even on A, which streams delta ids anyway)
        assert metric_value(metrics, "tally_stream_mode", {"mode": "cumulative"}) == 1


def run_adapter(gen: str, body: dict[str, Any], aborts: dict[str, tuple[int, str]]) -> Any:
    sglang.configure(version=GENERATIONS[gen], aborts=aborts)
    engine = SGLangEngine(settings().engine_config())

    async def go() -> Any:
        await engine.start()
        ids = engine.tokenize(body["prompt"])
        request = GenerationRequest("r1.", ids, SamplingParams(max_tokens=body["max_tokens"], temperature=0,
                                                               ignore_eos=True))
        return [d async for d in engine.generate(request)], engine

    return asyncio.run(go())


def test_waiting_queue_abort_emits_no_duplicate() -> None:
    deltas, _ = run_adapter("D", {"prompt": "abort me please", "max_tokens": 12}, {"abort me": (4, "waiting")})
    assert deltas[-1].finish_reason is FinishReason.ABORT
    assert deltas[-1].text == "" and deltas[-1].token_ids == ()
    assert sum(len(d.token_ids) for d in deltas) == deltas[-1].completion_tokens == 4


def test_abort_with_status_is_an_engine_error_in_band() -> None:
    sglang.configure(version=GENERATIONS["D"], aborts={"timeout": (3, "status")})
    with serving(create_app(settings(), SGLangEngine(settings().engine_config()))) as url:
        events = sse_payloads(httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": "this will timeout", "max_tokens": 9, "stream": True,
            "ignore_eos": True}).content)  # sampled at temperature 1: an early EOS would end it before the abort
        assert events[-2]["error"]["code"] == 503 and "timeout" in events[-2]["error"]["message"]
        assert events[-1] == "[DONE]"
        streamed = [e for e in events if isinstance(e, dict) and e.get("choices")]
        plain = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": "this will timeout", "max_tokens": 9, "ignore_eos": True})
        assert plain.status_code == 503  # non-stream: the engine's error is the response
        metrics = httpx.get(f"{url}/metrics").text
        # The abort's item carries the step's token, as real SGLang's running timeout does: both requests are
        # billed the engine's count (4 each), one more than the 3 tokens the stream relayed
        assert len(streamed) == 3
        assert metric_value(metrics, "tally_completion_tokens_total") == 8
        assert metric_value(metrics, "tally_usage_mismatches_total") == 0


def test_value_error_before_first_item_is_400() -> None:
    sglang.configure(version=GENERATIONS["D"])
    engine = SGLangEngine(settings().engine_config())

    async def go() -> None:
        await engine.start()
        request = GenerationRequest("r2.", [1] * 10, SamplingParams(max_tokens=5000))
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            async for _ in engine.generate(request):
                pass

    asyncio.run(go())


def test_owned_engine_args_are_rejected() -> None:
    sglang.configure(version=GENERATIONS["D"])
    engine = SGLangEngine(settings(engine_args=("--port", "9")).engine_config())
    with pytest.raises(ValueError, match="--port is set by Tally"):
        asyncio.run(engine.start())


@pytest.mark.parametrize("args", [
    pytest.param(("--trust-remote",), id="abbreviation"),
    pytest.param((" --trust-remote-code",), id="whitespace-before"),
    pytest.param(("--stream-interval=2 --trust-remote-code",), id="hidden-in-a-value"),
    pytest.param(("--stream-interval", "2", "--tp", "2"), id="abbreviated-owned"),
])
def test_engine_args_are_full_option_names_and_never_reach_trust_remote_code(args: tuple[str, ...]) -> None:
    sglang.configure(version=GENERATIONS["D"])
    engine = SGLangEngine(settings(engine_args=args).engine_config())
    with pytest.raises(ValueError):
        asyncio.run(engine.start())
    assert engine._engine is None


def test_tallys_own_arguments_win_over_pass_through_ones() -> None:
    sglang.configure(version=GENERATIONS["D"])
    engine = SGLangEngine(settings(engine_args=("--log-level=debug",), log_level="warning").engine_config())
    asyncio.run(engine.start())
    assert engine._engine.server_args.log_level == "warning"


def test_cli_form_of_the_switch_is_accepted_for_every_generation() -> None:
    for gen in "ABCD":
        sglang.configure(version=GENERATIONS[gen])
        flag = "--stream-output" if gen in "AB" else "--incremental-streaming-output"
        engine = SGLangEngine(settings(engine_args=(flag, "--stream-interval", "2")).engine_config())
        asyncio.run(engine.start())
        assert engine.health().ok and engine._engine.server_args.stream_interval == 2


@pytest.mark.parametrize("gen", ["A", "B", "C", "D"])
def test_disconnect_aborts_the_request_inside_sglang_on_every_generation(gen: str) -> None:
    """Only 0.5.20+ aborts when its generator is closed; older ones ran the request on for nobody."""
    sglang.configure(version=GENERATIONS[gen])
    engine = SGLangEngine(settings().engine_config())
    with serving(create_app(settings(), engine)) as url, httpx.stream(
            "POST", f"{url}/v1/completions", timeout=60,
            json={"prompt": "Count to one thousand:", "max_tokens": 300, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
    manager = engine._engine.tokenizer_manager
    from runtime_harness import until

    assert until(lambda: any(rid.startswith("cmpl-") for rid in manager.aborted), 10)
    assert manager.ghosts == []


def test_an_engine_refusal_at_prime_is_recorded_once_and_unbilled() -> None:
    """SGLang's waiting-queue timeout before the first token: a 503 before any byte, no usage."""
    sglang.configure(version=GENERATIONS["D"], aborts={"busy now": (0, "status")})
    with serving(create_app(settings(), SGLangEngine(settings().engine_config()))) as url:
        refused = httpx.post(f"{url}/v1/completions", timeout=60,
                             json={"prompt": "busy now", "max_tokens": 4, "stream": True})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["type"] == "service_unavailable_error"
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_value(metrics, "tally_requests_total") == 1
        assert metric_value(metrics, "tally_requests_total", {"outcome": "overloaded"}) == 1
        assert metric_value(metrics, "tally_prompt_tokens_total") == 0
        assert metric_value(metrics, "tally_derived_usage_requests_total") == 0


def test_top_k_zero_is_refused_before_the_engine_sees_it() -> None:
    sglang.configure(version=GENERATIONS["D"])
    with serving(create_app(settings(), SGLangEngine(settings().engine_config()))) as url:
        refused = httpx.post(f"{url}/v1/completions", json={**BODY, "top_k": 0}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_k"
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_value(metrics, "tally_requests_total", {"outcome": "invalid"}) == 1
        assert metric_value(metrics, "tally_requests_total") == 1


@pytest.mark.parametrize("version", ["0.5.10", "0.5.16"])
def test_logprobs_are_per_chunk_whether_sglang_slices_them_or_not(version: str) -> None:
    """0.5.10 still sent output logprob lists cumulatively in incremental mode; the probe finds out."""
    sglang.configure(version=version, coalesce=(1, 3))
    with serving(create_app(settings(), SGLangEngine(settings().engine_config()))) as url:
        body = {**BODY, "logprobs": 1}
        plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        events = sse_payloads(httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60).content)
        chunks = [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]]
        tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
        assert len(tokens) == 10 == len(plain["choices"][0]["logprobs"]["tokens"])
        assert "".join(tokens) == "".join(c["text"] for c in chunks) == plain["choices"][0]["text"]


def test_a_chat_template_that_writes_the_bos_gets_no_second_one() -> None:
    sglang.configure(version=GENERATIONS["D"], bos_template=True)
    engine = SGLangEngine(settings().engine_config())
    messages = [{"role": "user", "content": "Hi"}]
    with serving(create_app(settings(), engine)) as url:
        usage = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                           json={"messages": messages, "max_tokens": 2}).json()["usage"]
    tokenizer = engine._engine.tokenizer_manager.tokenizer
    text = tokenizer.apply_chat_template(messages)
    # what SGLang's own server sends: the template's text, its special tokens as written (tokenize=True)
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert expected[0] == tokenizer.model.bos and len(tokenizer.encode(text)) == len(expected) + 1
    assert list(engine._engine.tokenizer_manager.seen_prompts[-1]) == expected
    assert usage["prompt_tokens"] == len(expected)


def test_a_message_cannot_forge_role_tokens_through_the_sglang_tokenizer() -> None:
    sglang.configure(version=GENERATIONS["D"])
    with serving(create_app(settings(), SGLangEngine(settings().engine_config()))) as url:
        def prompt_tokens(content: str) -> int:
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
            return int(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]["prompt_tokens"])

        assert prompt_tokens("Hello there<|im_start|>") - prompt_tokens("Hello there") > 1


@pytest.mark.parametrize("gen", ["C", "D"])
def test_an_abort_sglang_ignored_while_tokenizing_is_sent_again_at_the_first_item(gen: str) -> None:
    """The client leaves while SGLang is still tokenizing its request: abort_request is a no-op then (the rid
    is not in rid_to_state yet). The adapter remembers it and sends it again once the first item shows the
    request registered, so the request ends at once, billed as far as SGLang generated it, instead of
    running to max_tokens for nobody."""
    sglang.configure(version=GENERATIONS[gen], zero_cost=True, token_seconds=0.001)
    engine = SGLangEngine(settings().engine_config())

    async def go() -> tuple[list[Delta], Any]:
        await engine.start()
        manager = engine._engine.tokenizer_manager
        choices = Choices(engine, [GenerationRequest("early.", (7, 7), SamplingParams(max_tokens=2000))])
        for _ in range(100):  # the pump opens the stream and SGLang starts tokenizing: a few loop turns
            if "early." in manager.tokenizing:
                break
            await asyncio.sleep(0)
        assert "early." in manager.tokenizing, "never caught the request while SGLang tokenized it"
        engine.abort("early.")
        assert manager.ignored_aborts == ["early."]  # SGLang did not take it
        deltas = [d async for batch in choices.batches() for _, d in batch]
        return deltas, manager

    try:
        deltas, manager = asyncio.run(go())
    finally:
        sglang.configure()
    assert deltas[-1].finish_reason is FinishReason.ABORT
    assert len(deltas) <= 3 and deltas[-1].completion_tokens == sum(len(d.token_ids) for d in deltas)
    assert "early." in manager.aborted and manager.ghosts == []

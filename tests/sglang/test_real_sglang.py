"""The SGLang adapter against SGLang 0.5.23's own engine (generation D) on the CPU.

Conformance, coalescing under a slow consumer, engine-sourced usage (cached tokens included), the
start-up probe, refusal of a cumulative engine, and aborts inside SGLang on disconnect.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from runtime_harness import free_port, metric_value, sse_payloads, until
from sglang_harness import ENGINE_ARG_FLAGS, ENGINE_ARGS, MODEL, sglang_env, start, stop

pytestmark = pytest.mark.sglang
PROMPT = "The capital of France is"


def content(events: list[Any]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e.get("choices")]


def test_probe_found_incremental_streaming(sglang_url: str) -> None:
    metrics = httpx.get(f"{sglang_url}/metrics").text
    assert metric_value(metrics, "tally_stream_mode", {"mode": "incremental"}) == 1
    assert metric_value(metrics, "tally_engine_healthy") == 1
    assert "sglang:num_running_reqs" in metrics  # SGLang's own series are served beside ours


def test_stream_equals_non_stream(sglang_url: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{sglang_url}/v1/completions", json=body, timeout=120).json()
    events = sse_payloads(httpx.post(f"{sglang_url}/v1/completions", timeout=120, json={
        **body, "stream": True, "stream_options": {"include_usage": True}}).content)
    text = "".join(c["choices"][0]["text"] for c in content(events))
    assert text == plain["choices"][0]["text"] and "Paris" in text
    usage = events[-2]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (plain["usage"]["prompt_tokens"], 10)
    assert events[-1] == "[DONE]"


def test_chat_stream(sglang_url: str) -> None:
    client = openai.OpenAI(base_url=f"{sglang_url}/v1", api_key="unused")
    chunks = list(client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens <= 12
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in {"stop", "length"} and all(f is None for f in finishes[:-1])


def test_slow_consumer_gets_coalesced_deltas_and_exact_usage(tmp_path: Any) -> None:
    """A consumer slower than decoding lets SGLang's backlog coalesce several tokens per item (§3).

    Driven on the adapter with the real engine in its own process (an HTTP client cannot slow the relay
    enough: socket buffers absorb a whole short stream; and SGLang's shutdown kills its host's children).
    """
    here = Path(__file__).parent
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(here / "slow_consumer.py"), str(MODEL), json.dumps(ENGINE_ARGS),
                           str(out)], env=sglang_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    fast, slow = result["fast"], result["slow"]
    assert max(len(ids) for ids in slow["ids"]) > 1, "no coalesced item under a slow consumer"
    for run in (fast, slow):
        assert sum(len(ids) for ids in run["ids"]) == run["completion_tokens"] == 40
    assert "".join(slow["text"]) == "".join(fast["text"])
    assert [t for ids in slow["ids"] for t in ids] == [t for ids in fast["ids"] for t in ids]


def test_repeated_prompt_reports_cached_tokens(sglang_url: str) -> None:
    body = {"prompt": "A long shared prefix about the history of the city of Lyon and its bridges", "max_tokens": 2}
    httpx.post(f"{sglang_url}/v1/completions", json=body, timeout=120)
    again = httpx.post(f"{sglang_url}/v1/completions", json=body, timeout=120).json()["usage"]
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] <= again["prompt_tokens"]


def test_drift_against_sglang_counters_is_zero(sglang_url: str) -> None:
    httpx.post(f"{sglang_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=120)
    metrics = httpx.get(f"{sglang_url}/metrics").text
    assert until(lambda: metric_value(httpx.get(f"{sglang_url}/metrics").text,
                                      "tally_engine_usage_drift_tokens", {"kind": "completion"}) == 0, 10)
    assert "sglang:generation_tokens_total" in metrics


def test_disconnect_aborts_inside_sglang(sglang_url: str) -> None:
    def running() -> float:
        return metric_value(httpx.get(f"{sglang_url}/metrics").text, "sglang:num_running_reqs")

    host, port = sglang_url.removeprefix("http://").split(":")
    body = b'{"prompt": "Count to one thousand:", "max_tokens": 1500, "ignore_eos": true, "stream": true}'
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert until(lambda: running() >= 1, 30)
    assert until(lambda: running() == 0 and metric_value(httpx.get(f"{sglang_url}/metrics").text,
                                                         "tally_inflight_generations") == 0, 30)


def test_cumulative_engine_is_refused(tmp_path: Any, sglang_url: str) -> None:
    """SGLang with incremental streaming off: /health 503 with the reason, deltas still right."""
    port = free_port()
    here = __file__.rsplit("/", 1)[0]
    proc, _ = start([sys.executable, f"{here}/cumulative_server.py", "--engine", "sglang", "--port", str(port),
                     "--model-path", str(MODEL), *ENGINE_ARG_FLAGS], tmp_path / "cumulative.log")
    url = f"http://127.0.0.1:{port}"
    try:
        def health() -> httpx.Response | None:
            try:
                response = httpx.get(f"{url}/health", timeout=2)
            except httpx.HTTPError:
                return None
            return response if "reason" in response.text else None

        assert until(lambda: health() is not None, 300), (tmp_path / "cumulative.log").read_text()[-3000:]
        refused = health()
        assert refused is not None and refused.status_code == 503
        assert "incremental streaming off" in refused.json()["reason"]
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_value(metrics, "tally_stream_mode", {"mode": "cumulative"}) == 1
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        plain = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        events = sse_payloads(httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=120).content)
        assert "".join(c["choices"][0]["text"] for c in content(events)) == plain["choices"][0]["text"]
        assert plain["usage"]["completion_tokens"] == 8
    finally:
        stop(proc)


def test_top_k_zero_is_refused_before_sglang_sees_it(sglang_url: str) -> None:
    """SGLang's SamplingParams.verify rejects it on the first iteration: it must be a 400 naming top_k."""
    before = httpx.get(f"{sglang_url}/metrics").text
    refused = httpx.post(f"{sglang_url}/v1/completions", timeout=120,
                         json={"prompt": PROMPT, "max_tokens": 4, "top_k": 0, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_k"
    after = httpx.get(f"{sglang_url}/metrics").text
    for name in ("tally_prompt_tokens_total", "tally_derived_usage_requests_total"):
        assert metric_value(after, name) == metric_value(before, name)


def test_chat_prompt_tokens_are_what_sglang_itself_counts(sglang_url: str) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    usage = httpx.post(f"{sglang_url}/v1/chat/completions", timeout=120,
                       json={"messages": messages, "max_tokens": 2}).json()["usage"]
    ids = AutoTokenizer.from_pretrained(str(MODEL)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids  # a BatchEncoding on newer transformers
    assert usage["prompt_tokens"] == len(ids)  # SGLang's serving_chat tokenizes exactly this way


def test_sigterm_lets_the_stream_finish_although_sglang_has_its_own_handler(tmp_path: Any) -> None:
    """SGLang installs a SIGTERM handler on the serving loop that could end the process mid-stream."""
    port = free_port()
    log = tmp_path / "drain.log"
    proc, _ = start([sys.executable, "-m", "tally_runtime", "serve", "--engine", "sglang", "--port", str(port),
                     "--model-path", str(MODEL), *ENGINE_ARG_FLAGS], log)
    url = f"http://127.0.0.1:{port}"
    try:
        from runtime_harness import wait_healthy

        wait_healthy(url, proc, log, deadline=300)
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            body = iter(response.iter_bytes())
            received = [next(body)]
            proc.send_signal(signal.SIGTERM)
            received.extend(body)
        events = sse_payloads(b"".join(received))
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 24
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        stop(proc)


def test_disconnects_bill_what_sglang_generated_so_drift_stays_zero(sglang_url: str) -> None:
    """Each disconnect leaves SGLang a token it generated and counted after the last item read; Tally
    aborts, reads SGLang's final item for the request and bills that, so the two never drift apart."""
    def metrics() -> str:
        return httpx.get(f"{sglang_url}/metrics").text

    def idle() -> bool:
        text = metrics()
        return metric_value(text, "tally_inflight_generations") == 0 and \
            metric_value(text, "sglang:num_running_reqs") == 0

    def drift() -> float:
        return metric_value(metrics(), "tally_engine_usage_drift_tokens", {"kind": "completion"})

    assert until(idle, 60)
    before, aborted = drift(), metric_value(metrics(), "tally_requests_total", {"outcome": "aborted"})
    host, port = sglang_url.removeprefix("http://").split(":")
    for cut in range(6):
        body = json.dumps({"prompt": f"Story {cut}:", "max_tokens": 300, "ignore_eos": True,
                           "stream": True}).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            received = b""
            while received.count(b"data: ") < 1 + cut % 3:
                received += sock.recv(4096)
    assert until(lambda: idle() and metric_value(metrics(), "tally_requests_total", {"outcome": "aborted"})
                 == aborted + 6, 120)
    assert until(lambda: drift() == before, 30), f"drift moved from {before} to {drift()}"


def test_a_message_cannot_forge_role_tokens(sglang_url: str) -> None:
    """SGLang's Hugging Face tokenizer with split_special_tokens for message content."""
    def prompt_tokens(content: str) -> int:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        return int(httpx.post(f"{sglang_url}/v1/chat/completions", json=body, timeout=120).json()["usage"][
            "prompt_tokens"])

    assert prompt_tokens("Hello there<|im_start|>") - prompt_tokens("Hello there") > 1


def both_ways(client: openai.OpenAI, kwargs: Any, calls: int = 20) -> list[Any]:
    """`calls` requests, half through the SDK's `parse()`, half through its `stream()` helper (with usage),
    four at a time; each reply has its usage."""
    def one(i: int) -> Any:
        if i % 2:
            return client.chat.completions.parse(**kwargs)
        with client.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as stream:
            for _ in stream:
                pass
            return stream.get_final_completion()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(one, range(calls)))
    assert all(r.usage is not None for r in replies)
    return replies


class City(BaseModel):
    name: str = Field(max_length=24)
    population: int
    coastal: bool
    continent: Literal["Africa", "Asia", "Europe", "America", "Oceania"]


def test_a_pydantic_response_format_is_constrained_by_sglangs_grammar_and_billed_as_counted(sglang_url: str) -> None:
    """SGLang's xgrammar backend constrains the output: 20 of 20 parse, streamed or not, and what the clients
    were told sums to what /metrics counted. A schema xgrammar cannot compile is a 400 before admission."""
    client = openai.OpenAI(base_url=f"{sglang_url}/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "Describe a large city as JSON."}]

    def counted() -> list[float]:
        text = httpx.get(f"{sglang_url}/metrics").text
        return [metric_value(text, "tally_requests_total", {"outcome": "ok"}),
                metric_value(text, "tally_prompt_tokens_total"), metric_value(text, "tally_completion_tokens_total")]

    # The grammar bounds the shape, the name's length and (Tally's default) each run of whitespace, not an
    # integer's digits: 400 tokens leave room at 0.8 without changing what is tested
    kwargs: Any = {"model": "smollm2-135m-instruct", "messages": messages, "response_format": City,
                   "max_tokens": 400, "temperature": 0.8}
    before = counted()
    replies = both_ways(client, kwargs)  # four at a time: SGLang batches them
    for reply in replies:
        assert isinstance(reply.choices[0].message.parsed, City), reply.choices[0].message.content
    told = [len(replies), sum(r.usage.prompt_tokens for r in replies), sum(r.usage.completion_tokens for r in replies)]
    assert [a - b for a, b in zip(counted(), before, strict=True)] == told
    bad = httpx.post(f"{sglang_url}/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text
    assert "nope" in bad.json()["error"]["message"]


class GetWeather(BaseModel):
    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "GetWeather"}}])
def test_required_and_named_tool_calls_are_constrained_by_sglangs_grammar(sglang_url: str, choice: Any) -> None:
    """`tool_choice` required or named on the real engine: 20 of 20 calls parse and validate, streamed or not."""
    client = openai.OpenAI(base_url=f"{sglang_url}/v1", api_key="unused", max_retries=0)
    kwargs: Any = {"model": "smollm2-135m-instruct", "max_tokens": 400, "temperature": 0.8,  # as above
                   "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                   "tools": [openai.pydantic_function_tool(GetWeather)], "tool_choice": choice,
                   "parallel_tool_calls": False}
    for reply in both_ways(client, kwargs):
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0]
        calls = reply.choices[0].message.tool_calls or []
        assert len(calls) == 1 and isinstance(calls[0].function.parsed_arguments, GetWeather)


def test_tool_choice_auto_reads_calls_with_sglangs_own_parser_for_the_model_family() -> None:
    """`--tool-call-parser` (spec.engine.args) picks SGLang's FunctionCallParser: the adapter reads a model's
    calls and the text around them with it, and Tally returns OpenAI's tool_calls; without one, auto is a 400
    (the shared server below runs none)."""
    from types import SimpleNamespace

    from tally_runtime.engine.base import EngineConfig
    from tally_runtime.engine.sglang import SGLangEngine
    from tally_runtime.tools import ToolPlan, tool_calls

    engine = SGLangEngine(EngineConfig())
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    engine._engine = SimpleNamespace(server_args=SimpleNamespace(tool_call_parser=None))
    assert engine.tool_parser(tools) is None
    engine._engine = SimpleNamespace(server_args=SimpleNamespace(tool_call_parser="qwen25"))
    parse = engine.tool_parser(tools)
    assert parse is not None
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = tool_calls(ToolPlan(None, parse=parse), text)
    assert content is not None and content.strip() == "Let me look."
    assert calls is not None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_weather", {"city": "Paris"})]
    assert tool_calls(ToolPlan(None, parse=parse), "Just text.") == ("Just text.", None)


def test_tool_choice_auto_without_a_parser_answers_in_the_generic_format(sglang_url: str) -> None:
    """No --tool-call-parser: `auto` is constrained by xgrammar to calls or a response, so it always parses."""
    client = openai.OpenAI(base_url=f"{sglang_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=200, temperature=0.8, parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[openai.pydantic_function_tool(GetWeather)])
    choice = reply.choices[0]
    if choice.finish_reason == "tool_calls":
        GetWeather.model_validate_json((choice.message.tool_calls or [])[0].function.arguments)
    else:
        assert choice.message.content is not None and not choice.message.content.startswith('{"response"')


def test_tools_with_a_structured_final_answer_on_sglangs_engine_give_calls_or_the_answer(sglang_url: str) -> None:
    """Tools together with a `response_format` (issue 62, item 1): xgrammar constrains the output to calls or a
    response in the schema; each reply parses into a call or the pydantic model, streamed or not."""
    client = openai.OpenAI(base_url=f"{sglang_url}/v1", api_key="unused", max_retries=0)
    kwargs: Any = {"model": "smollm2-135m-instruct", "max_tokens": 400, "temperature": 0.8,
                   "messages": [{"role": "user", "content": "Describe a large city as JSON."}],
                   "tools": [openai.pydantic_function_tool(GetWeather)], "response_format": City}
    for reply in both_ways(client, kwargs, calls=4):
        choice = reply.choices[0]
        if choice.finish_reason == "tool_calls":
            assert isinstance((choice.message.tool_calls or [])[0].function.parsed_arguments, GetWeather)
        else:
            assert isinstance(choice.message.parsed, City), choice.message.content


def test_the_pickers_gauges_are_sglangs_own_plus_tallys_queue(tmp_path: Any) -> None:
    """`--model-server-metrics` on the real engine: an endpoint picker reading this pod as SGLang sees Tally's
    admission queue in `sglang:num_queue_reqs`, SGLang's running count and KV fraction, and its token pool
    as `sglang:cache_config_info` (which SGLang 0.5.23 itself does not export)."""
    from prometheus_client.parser import text_string_to_metric_families

    port, metrics_port = free_port(), free_port()
    log = tmp_path / "picker.log"
    proc, _ = start([sys.executable, "-m", "tally_runtime", "serve", "--engine", "sglang", "--port", str(port),
                     "--metrics-port", str(metrics_port), "--model-server-metrics", "--max-concurrent-generations",
                     "1", "--model-path", str(MODEL), *ENGINE_ARG_FLAGS], log)
    url = f"http://127.0.0.1:{port}"

    def gauges() -> dict[str, tuple[str, dict[str, str], float]]:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return {s.name: (f.type, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}

    try:
        from runtime_harness import wait_healthy

        wait_healthy(url, proc, log, deadline=300)
        idle = gauges()
        assert {name: kind for name, (kind, _, _) in idle.items()} == {
            "sglang:num_queue_reqs": "gauge", "sglang:num_running_reqs": "gauge", "sglang:token_usage": "gauge",
            "sglang:cache_config_info": "gauge"}
        _, info, _ = idle["sglang:cache_config_info"]
        assert int(info["page_size"]) >= 1 and int(info["num_pages"]) > 0
        ended = threading.Event()

        def stream() -> None:
            # each client leaves at its first chunk once the gauges are read: the running stream is aborted, the
            # next one admitted, and so on (600 tokens each to the end would be minutes on this CPU)
            with httpx.Client(timeout=300) as client, client.stream("POST", f"{url}/v1/completions", json={
                    "prompt": PROMPT, "max_tokens": 600, "ignore_eos": True, "stream": True}) as response:
                for _ in response.iter_raw():
                    if ended.is_set():
                        return

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream) for _ in range(3)]
            try:
                assert until(lambda: gauges()["sglang:num_running_reqs"][2] == 1
                             and gauges()["sglang:num_queue_reqs"][2] == 2, 120, interval=0.2), gauges()
                assert until(lambda: 0 < gauges()["sglang:token_usage"][2] <= 1, 120, interval=0.2), gauges()
                page = httpx.get(f"{url}/metrics").text
                assert "tally_" not in page and "tenant" not in page
            finally:
                ended.set()
            for done in streams:
                done.result(timeout=120)
        assert until(lambda: gauges()["sglang:num_running_reqs"][2] == 0, 120, interval=0.2), gauges()
    finally:
        stop(proc)


def test_the_responses_api_on_sglangs_engine_creates_streams_and_parses_billed_as_counted(sglang_url: str) -> None:
    """`/v1/responses` through the same core on the real engine: a text response, a stream whose deltas join
    to its final text, `responses.parse()` constrained by xgrammar (each valid), a named function call; what
    the clients were told sums to what /metrics counted."""
    client = openai.OpenAI(base_url=f"{sglang_url}/v1", api_key="unused", max_retries=0)
    model = "smollm2-135m-instruct"

    def counted() -> list[float]:
        text = httpx.get(f"{sglang_url}/metrics").text
        return [metric_value(text, "tally_requests_total", {"outcome": "ok", "endpoint": "responses"}),
                metric_value(text, "tally_prompt_tokens_total"), metric_value(text, "tally_completion_tokens_total")]

    before = counted()
    replies: list[Any] = [client.responses.create(model=model, input=PROMPT, max_output_tokens=8)]
    assert replies[0].output_text and replies[0].status in ("completed", "incomplete")
    with client.responses.stream(model=model, input=[{"role": "user", "content": "Name a colour."}],
                                 max_output_tokens=8) as stream:
        events = list(stream)
    replies.append(events[-1].response)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == replies[-1].output_text
    for _ in range(4):
        parsed = client.responses.parse(model=model, input="Describe a large city as JSON.", text_format=City,
                                        max_output_tokens=400, temperature=0.8)
        assert isinstance(parsed.output_parsed, City)
        replies.append(parsed)
    weather = {"type": "function", "name": "GetWeather", "parameters": GetWeather.model_json_schema()}
    called = client.responses.create(model=model, input="What is the weather in Paris?", tools=[weather],
                                     tool_choice={"type": "function", "name": "GetWeather"}, max_output_tokens=400)
    replies.append(called)
    call = next(item for item in called.output if item.type == "function_call")
    GetWeather.model_validate_json(call.arguments)
    told = [len(replies), sum(r.usage.input_tokens for r in replies), sum(r.usage.output_tokens for r in replies)]
    assert [a - b for a, b in zip(counted(), before, strict=True)] == told

"""The Responses API (`POST /v1/responses`) on the embedded CPU model, as the `openai` SDK drives it:
`responses.create`, `responses.stream()` (text and function calls), `responses.parse()` with a pydantic model,
a function-call round trip with `function_call_output`, and the refusals (stateful parameters, unsupported
items, a context overrun), each a 400 naming its parameter with nothing billed. Usage is the engine's count,
as for chat: what the clients were told sums to the usage records and to /metrics, exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from runtime_harness import metric_value, runtime_process, until

PARSES = 20
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}


class City(BaseModel):
    name: str = Field(max_length=24)
    population: int
    coastal: bool
    continent: Literal["Africa", "Asia", "Europe", "America", "Oceania"]


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("records") / "records.jsonl"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, records: Path) -> Iterator[str]:
    log = tmp_path_factory.mktemp("responses") / "rt.log"
    with runtime_process(log, "--max-concurrent-generations", "2", "--usage-records-file", str(records)) as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def records_of(records: Path, ids: list[str]) -> list[dict[str, Any]]:
    """The usage records of these responses (each is written as its request closes, just after the response)."""
    def written() -> list[dict[str, Any]]:
        found = [r for r in map(json.loads, records.read_text().splitlines()) if r["id"] in ids]
        return found if len(found) == len(ids) else []

    assert until(written, 30), "a model call's usage record was not written"
    return written()


class Books:
    """What the clients were told, response by response."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.input = self.output = 0

    def add(self, response: Any) -> None:
        usage = response.usage
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        assert usage.input_tokens > 0 and usage.output_tokens_details.reasoning_tokens == 0
        self.ids.append(response.id)
        self.input += usage.input_tokens
        self.output += usage.output_tokens


def counted(url: str) -> tuple[float, float, float]:
    text = httpx.get(f"{url}/metrics").text
    return (metric_value(text, "tally_requests_total", {"outcome": "ok", "endpoint": "responses"}),
            metric_value(text, "tally_prompt_tokens_total"), metric_value(text, "tally_completion_tokens_total"))


def recorded(records: Path, ids: list[str]) -> list[Any]:
    """(records, endpoints, prompt tokens, completion tokens) of these responses in the usage records."""
    def written() -> dict[str, Any]:
        by_id = {r["id"]: r for r in map(json.loads, records.read_text().splitlines())}
        return by_id if all(i in by_id for i in ids) else {}

    assert until(written, 30), "a response's usage record was not written"
    mine = [written()[i] for i in ids]
    return [len(mine), {r["endpoint"] for r in mine}, sum(r["prompt_tokens"] for r in mine),
            sum(r["completion_tokens"] for r in mine)]


def test_responses_create_stream_parse_and_calls_are_billed_exactly_as_clients_were_told(
        url: str, client: openai.OpenAI, model: str, records: Path) -> None:
    before = counted(url)
    books = Books()

    text = client.responses.create(model=model, input="Say hello.", instructions="Answer briefly.",
                                   max_output_tokens=12, metadata={"ticket": "T-1"}, temperature=0)
    books.add(text)
    assert text.object == "response" and text.id.startswith("resp_") and text.store is False
    assert text.status in ("completed", "incomplete") and text.output_text
    assert text.metadata == {"ticket": "T-1"} and text.max_output_tokens == 12

    cut = client.responses.create(model=model, input="Count from one to one hundred.", max_output_tokens=3)
    books.add(cut)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.usage.output_tokens == 3

    with client.responses.stream(model=model, input=[{"role": "user", "content": "Name a colour."}],
                                 max_output_tokens=8) as stream:
        events = list(stream)
    streamed = events[-1].response  # response.completed, or response.incomplete when cut at 8 tokens
    books.add(streamed)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{streamed.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == streamed.output_text and streamed.usage.output_tokens > 0

    parsed = 0
    for i in range(PARSES):
        reply = client.responses.parse(model=model, input=f"Describe city number {i} as JSON.", text_format=City,
                                       max_output_tokens=120, temperature=0.7)
        books.add(reply)
        parsed += isinstance(reply.output_parsed, City)
    assert parsed == PARSES

    called = client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     max_output_tokens=40)
    books.add(called)
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    # the round trip: the call and its output go back as items, the model answers in text
    answer = client.responses.create(model=model, max_output_tokens=16, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ])
    books.add(answer)
    assert answer.output[0].type == "message" and answer.output_text

    # one call: with parallel calls allowed this model can list calls until the limit cuts the array (then it
    # is text, rightly); several calls in one stream are driven through the renderer in the unit tests
    with client.responses.stream(model=model, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=80) as stream:
        events = list(stream)
        final = stream.get_final_response()
    books.add(final)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = [(e.item_id, e.arguments) for e in events if e.type == "response.function_call_arguments.done"]
    calls = [(item.id, item.arguments) for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls == done and final.parallel_tool_calls is False

    after = counted(url)
    assert after[0] - before[0] == len(books.ids)
    assert (after[1] - before[1], after[2] - before[2]) == (books.input, books.output)
    assert recorded(records, books.ids) == [len(books.ids), {"responses"}, books.input, books.output]


def test_an_agent_with_a_function_tool_runs_end_to_end_billed_to_its_tenant(url: str, records: Path) -> None:
    """The OpenAI Agents SDK (its Responses model, tool_choice auto after the first call: the generic format on
    this engine) runs its loop against Tally: the tool is called, its output goes back as an item, the agent
    answers. Every model call is recorded under the agent's tenant, and what the SDK summed is what was billed."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would send traces to OpenAI: nothing leaves this machine
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"Sunny, 21 C in {city}"

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                default_headers={"X-Tally-Tenant": "agents"})
    agent = Agent(name="weather", instructions="Answer questions about the weather using the tool.",
                  tools=[get_weather], model=OpenAIResponsesModel("smollm2-135m-instruct", client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80))
    before = counted(url)
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=6))
    assert called and isinstance(result.final_output, str) and result.final_output
    ids = [str(r.response_id) for r in result.raw_responses]
    usage = result.context_wrapper.usage
    assert usage.requests == len(ids) >= 2
    mine = records_of(records, ids)
    assert {(r["tenant"], r["endpoint"], r["outcome"]) for r in mine} == {("agents", "responses", "ok")}
    assert (len(mine), sum(r["prompt_tokens"] for r in mine), sum(r["completion_tokens"] for r in mine)) == \
        (len(ids), usage.input_tokens, usage.output_tokens)
    after = counted(url)
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == \
        (len(ids), usage.input_tokens, usage.output_tokens)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "max_output_tokens": 10**7}, "input"),  # context_length_exceeded, as chat names messages
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format"),
    ({"input": []}, "input"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
])
def test_what_cannot_be_served_is_a_400_naming_the_parameter_and_bills_nothing(
        url: str, model: str, body: dict[str, Any], param: str) -> None:
    before = counted(url)
    reply = httpx.post(f"{url}/v1/responses", json={"model": model, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert counted(url) == before


def test_a_stored_response_is_never_found(url: str) -> None:
    for method in ("GET", "DELETE"):
        reply = httpx.request(method, f"{url}/v1/responses/resp_abc", timeout=10)
        assert reply.status_code == 404 and "stores no responses" in reply.json()["error"]["message"]


def test_a_client_that_leaves_mid_stream_is_billed_what_the_engine_generated(url: str, model: str,
                                                                              records: Path) -> None:
    """The stream is closed after its first text delta: the generation is aborted in the engine, and what it
    generated is what the record and /metrics say, the same count."""
    before = httpx.get(f"{url}/metrics").text
    with httpx.stream("POST", f"{url}/v1/responses", timeout=60, json={
            "model": model, "input": "Write a long story about the sea.", "max_output_tokens": 200,
            "ignore_eos": True, "stream": True}) as reply:
        assert reply.status_code == 200
        response_id = ""
        for line in reply.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                response_id = response_id or event["response"]["id"]
                if event["type"] == "response.output_text.delta":
                    break  # the client leaves

    def record() -> dict[str, Any] | None:
        return next((r for r in map(json.loads, records.read_text().splitlines()) if r["id"] == response_id), None)

    assert until(lambda: record() is not None, 30), "the aborted response was not recorded"
    billed = record()
    assert billed is not None and billed["outcome"] == "aborted" and 1 <= billed["completion_tokens"] < 200
    after = httpx.get(f"{url}/metrics").text
    name = "tally_completion_tokens_total"
    assert metric_value(after, name) - metric_value(before, name) == billed["completion_tokens"]


def test_an_agent_with_a_tool_and_a_pydantic_output_type_runs_end_to_end_billed_to_its_tenant(
        url: str, records: Path) -> None:
    """Issue 62, item 1: an Agents SDK `Agent(tools=…, output_type=…)` was refused on its first model call (tools
    with `text.format`). The generic format offers the tool or the final answer in the output type's schema."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel

    set_tracing_disabled(True)
    called: list[str] = []

    class Forecast(BaseModel):
        city: str
        summary: str

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"Sunny, 21 C in {city}"

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                default_headers={"X-Tally-Tenant": "agents-typed"})
    agent = Agent(name="weather", instructions="Answer questions about the weather using the tool.",
                  tools=[get_weather], output_type=Forecast,
                  model=OpenAIResponsesModel("smollm2-135m-instruct", client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=120))
    before = counted(url)
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=6))
    assert called and isinstance(result.final_output, Forecast), result.final_output
    ids = [str(r.response_id) for r in result.raw_responses]
    usage = result.context_wrapper.usage

    mine = records_of(records, ids)
    assert {(r["tenant"], r["outcome"]) for r in mine} == {("agents-typed", "ok")}
    assert (len(mine), sum(r["prompt_tokens"] for r in mine), sum(r["completion_tokens"] for r in mine)) == \
        (len(ids), usage.input_tokens, usage.output_tokens)
    after = counted(url)
    assert (after[1] - before[1], after[2] - before[2]) == (usage.input_tokens, usage.output_tokens)


def test_truncation_auto_drops_the_oldest_turns_to_fit_the_context_and_disabled_refuses(url: str, model: str) -> None:
    """Issue 62, item 6: `truncation: "auto"` was echoed but not applied (a conversation past the context was a
    400 either way). Now the oldest turns go, as few as make it fit; the instructions stay."""
    context = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0].get("context_length") or 2048
    turn = "Tell me more about the history of the town and its river. " * 25  # about 300 tokens
    items: list[dict[str, Any]] = []
    for i in range(2 * (context // 300 + 2)):
        items.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {turn}"})
    items.append({"role": "user", "content": "And today?"})
    body = {"model": model, "instructions": "Be brief.", "input": items, "max_output_tokens": 8}
    refused = httpx.post(f"{url}/v1/responses", json=body, timeout=120)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    served = httpx.post(f"{url}/v1/responses", json={**body, "truncation": "auto"}, timeout=120)
    assert served.status_code == 200, served.text
    used = served.json()["usage"]["input_tokens"]
    assert context - 8 - 400 < used <= context - 8, (used, context)  # as much as fits: one turn fewer would not
    assert served.json()["truncation"] == "auto"


def test_include_logprobs_returns_each_output_tokens_logprob_streamed_or_not(client: openai.OpenAI, model: str) -> None:
    """Issue 62, item 6: `include: ["message.output_text.logprobs"]` returned an empty list (and `top_logprobs` was
    a 400). Each output token comes with its logprob and `top_logprobs` alternatives, as chat's do."""
    reply = client.responses.create(model=model, input="Say hi", max_output_tokens=5, top_logprobs=2,
                                    include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})
    part = reply.output[0].content[0]  # type: ignore[union-attr]
    assert reply.usage is not None and len(part.logprobs or []) == reply.usage.output_tokens == 5
    assert all(len(lp.top_logprobs) >= 2 and lp.logprob <= 0 for lp in part.logprobs or [])
    assert "".join(lp.token for lp in part.logprobs or []) == part.text
    events = list(client.responses.create(model=model, input="Say hi", max_output_tokens=5, top_logprobs=1,
                                          include=["message.output_text.logprobs"], stream=True,
                                          extra_body={"ignore_eos": True}))
    deltas = [lp for event in events if event.type == "response.output_text.delta" for lp in event.logprobs]
    assert events[-1].type == "response.incomplete"  # cut at max_output_tokens, as asked
    done = events[-1].response.output[0].content[0]  # type: ignore[union-attr]
    assert len(deltas) == len(done.logprobs or []) == 5
    plain = client.responses.create(model=model, input="Say hi", max_output_tokens=3)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


def test_an_agent_with_a_handoff_two_tools_and_an_output_type_runs_end_to_end_billed_exactly(
        url: str, records: Path) -> None:
    """Issue 62's agent: a triage agent hands off to one with two function tools and a pydantic `output_type`; the
    handoff (a tool call the SDK turns into the next agent), the tool calls and the typed final answer all go
    through Tally's Responses route, and every model call is billed to the tenant exactly as the SDK summed it."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel

    set_tracing_disabled(True)
    called: list[str] = []

    class Forecast(BaseModel):
        city: str
        summary: str

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(f"weather:{city}")
        return f"Sunny, 21 C in {city}"

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        called.append(f"time:{city}")
        return f"It is 14:00 in {city}"

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                default_headers={"X-Tally-Tenant": "agents-handoff"})
    model = OpenAIResponsesModel("smollm2-135m-instruct", client)
    settings = ModelSettings(tool_choice="required", temperature=0, max_tokens=120)
    weather = Agent(name="weather", instructions="Answer questions about the weather using the tools.",
                    tools=[get_weather, get_time], output_type=Forecast, model=model, model_settings=settings)
    triage = Agent(name="triage", instructions="Hand weather questions to the weather agent.", handoffs=[weather],
                   model=model, model_settings=settings)
    result = asyncio.run(Runner.run(triage, "What is the weather in Paris?", max_turns=8))
    assert result.last_agent.name == "weather" and called, called
    assert isinstance(result.final_output, Forecast), result.final_output
    ids = [str(r.response_id) for r in result.raw_responses]
    usage = result.context_wrapper.usage

    mine = records_of(records, ids)
    assert {(r["tenant"], r["outcome"]) for r in mine} == {("agents-handoff", "ok")} and len(mine) >= 3
    assert (sum(r["prompt_tokens"] for r in mine), sum(r["completion_tokens"] for r in mine)) == \
        (usage.input_tokens, usage.output_tokens)

"""Usage records and tenant counters, checked against what each `openai` SDK client received.

One real `tally-runtime serve` process; clients of three tenants (by header, by the `user` field, and one
beyond --max-tenants) send streamed, plain, n>1, no-include_usage, aborted and refused requests at once.
Every request gets exactly one record, the records agree with each client, and their sums equal /metrics.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
from runtime_harness import metric_value, runtime_process

MODEL = "smollm2-135m-instruct"


def client(url: str, tenant: str | None = None) -> openai.OpenAI:
    headers = {"X-Tally-Tenant": tenant} if tenant else None
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, default_headers=headers)


def streamed(url: str, tenant: str, prompt: str) -> dict[str, Any]:
    chunks = list(client(url, tenant).completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None
    return {"id": chunks[0].id, "tenant": tenant, "outcome": "ok", "prompt": usage.prompt_tokens,
            "completion": usage.completion_tokens}


def plain_with_user(url: str, user: str, prompt: str) -> dict[str, Any]:
    reply = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=6, user=user)
    assert reply.usage is not None
    return {"id": reply.id, "tenant": user, "outcome": "ok", "prompt": reply.usage.prompt_tokens,
            "completion": reply.usage.completion_tokens}


def two_choices(url: str, tenant: str) -> dict[str, Any]:
    reply = client(url, tenant).completions.create(model=MODEL, prompt="Colors:", max_tokens=5, n=2)
    assert reply.usage is not None and len(reply.choices) == 2
    return {"id": reply.id, "tenant": tenant, "outcome": "ok", "prompt": reply.usage.prompt_tokens,
            "completion": reply.usage.completion_tokens, "n": 2}


def without_include_usage(url: str, tenant: str) -> dict[str, Any]:
    chunks = list(client(url, tenant).completions.create(model=MODEL, prompt="Count:", max_tokens=7, stream=True,
                                                         extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in chunks)  # nothing asked, nothing sent: the record has it all the same
    return {"id": chunks[0].id, "tenant": tenant, "outcome": "ok", "completion": 7}


def aborted(url: str, tenant: str) -> dict[str, Any]:
    stream = client(url, tenant).completions.create(model=MODEL, prompt="A long story:", max_tokens=300,
                                                    stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    stream.close()
    return {"id": first.id, "tenant": tenant, "outcome": "aborted", "at_least": 1}


def refused(url: str, tenant: str) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/completions", headers={"X-Tally-Tenant": tenant}, timeout=60,
                          json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert response.status_code == 400
    return {"id": None, "tenant": tenant, "outcome": "invalid", "prompt": 0, "completion": 0}


def test_every_request_has_one_record_that_matches_its_client_and_metrics(tmp_path: Path) -> None:
    records_file = tmp_path / "usage.jsonl"
    with runtime_process(tmp_path / "rt.log", "--usage-records-file", str(records_file), "--max-tenants", "2") \
            as (_, url):
        calls: list[Callable[[], dict[str, Any]]] = [
            *(lambda i=i: streamed(url, "team-a", f"Story {i}:") for i in range(3)),
            lambda: plain_with_user(url, "user-7", "Hi"), lambda: two_choices(url, "team-a"),
            lambda: without_include_usage(url, "user-7"), lambda: aborted(url, "team-a"),
            lambda: refused(url, "user-7"),
        ]
        # beyond --max-tenants 2, and only once both have been seen: run at once with the rest, a late one
        # finishing first took a named tenant's place (under a loaded machine's scheduling)
        late: list[Callable[[], dict[str, Any]]] = [
            lambda i=i: streamed(url, "late-tenant", f"Late {i}:") for i in range(2)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            sent = list(pool.map(lambda call: call(), calls))
            sent += list(pool.map(lambda call: call(), late))
        metrics = httpx.get(f"{url}/metrics").text
    records = [json.loads(line) for line in records_file.read_text().splitlines()]
    assert len(records) == len(sent) and all(r["schema"] == "tally.usage.v1" for r in records)
    by_id = {r["id"]: r for r in records}
    for expected in sent:
        record = by_id[expected["id"]] if expected["id"] else next(r for r in records if r["outcome"] == "invalid")
        assert (record["tenant"], record["outcome"]) == (expected["tenant"], expected["outcome"]), record
        if "prompt" in expected:
            assert record["prompt_tokens"] == expected["prompt"]
        if "completion" in expected:
            assert record["completion_tokens"] == expected["completion"]
        if "at_least" in expected:
            assert record["completion_tokens"] >= expected["at_least"]
            assert record["finish_reasons"] == [None]
        assert record["n"] == expected.get("n", 0 if record["outcome"] == "invalid" else 1)
    # the sums of the records are the counters, exactly
    for field, series in (("prompt_tokens", "tally_prompt_tokens_total"),
                          ("completion_tokens", "tally_completion_tokens_total")):
        assert sum(r[field] for r in records) == metric_value(metrics, series), series
    assert len(records) == metric_value(metrics, "tally_requests_total")
    # per tenant: two named, the third one beyond the bound is booked to "other" and counted as such
    for tenant, label in (("team-a", "team-a"), ("user-7", "user-7"), ("late-tenant", "other")):
        mine = [r for r in records if r["tenant"] == tenant]
        assert metric_value(metrics, "tally_tenant_completion_tokens_total", {"tenant": label}) == \
            sum(r["completion_tokens"] for r in mine)
        served = [r for r in mine if r["outcome"] not in {"invalid", "overloaded"}]  # as the totals count them
        assert metric_value(metrics, "tally_tenant_requests_total", {"tenant": label}) == len(served)
    assert metric_value(metrics, "tally_tenant_overflow_requests_total") == 2
    # standard output carries the same records (logs go to standard error)
    stdout_lines = [line for line in (tmp_path / "rt.log").read_text().splitlines() if line.startswith('{"schema"')]
    assert sorted(json.loads(line)["id"] for line in stdout_lines) == sorted(r["id"] for r in records)


def test_records_as_cloudevents_are_what_a_metering_system_ingests(tmp_path: Path) -> None:
    """Each record a CloudEvent (read back with the CloudEvents SDK, which validates it): the response id as
    `id` (a retried delivery is deduplicated), the pod as `source`, the tenant as `subject`, the record as
    `data`; their sums are the counters."""
    from cloudevents.core.formats.json import JSONFormat

    records_file = tmp_path / "events.jsonl"
    source = "/namespaces/team-a/completionservices/smollm/pods/smollm-0"
    with runtime_process(tmp_path / "rt.log", "--usage-records-file", str(records_file), "--usage-records-format",
                         "cloudevents", "--usage-source", source) as (_, url):
        sent = [streamed(url, "team-a", "Story:"), plain_with_user(url, "user-7", "Hi"), refused(url, "team-a")]
        metrics = httpx.get(f"{url}/metrics").text
    events = [JSONFormat().read(None, line) for line in records_file.read_bytes().splitlines()]
    assert len(events) == len(sent) and len({e.get_id() for e in events}) == len(events)
    for event in events:
        assert (event.get_specversion(), event.get_type(), event.get_source()) == ("1.0", "dev.tally.usage.v1", source)
        data = event.get_data()
        assert isinstance(data, dict) and data["schema"] == "tally.usage.v1"
        assert event.get_id() == data["id"] and event.get_subject() == data["tenant"]
    by_id = {e.get_id(): e.get_data() for e in events}
    for expected in sent[:2]:
        record = by_id[expected["id"]]
        assert (record["tenant"], record["completion_tokens"]) == (expected["tenant"], expected["completion"])
    assert sum(e.get_data()["completion_tokens"] for e in events) == \
        metric_value(metrics, "tally_completion_tokens_total")  # type: ignore[index]

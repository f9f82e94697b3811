"""Token budgets on a real `tally-runtime serve` process: reserve at admission, settle to the engine's count.

The leases are posted as the operator posts them (signed with its key); the requests are real ones to the
CPU engine, concurrently, and what the tenant spent is summed from what its clients were told."""

from __future__ import annotations

import base64
import concurrent.futures
import itertools
import json
from pathlib import Path
from typing import Any

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from runtime_harness import free_port, metric_value, runtime_process, sse_payloads, until

PROMPT = {"prompt": "Say something:", "max_tokens": 8, "ignore_eos": True}


SEQ = itertools.count(1)


def post_leases(http: httpx.Client, key: Ed25519PrivateKey, tenants: dict[str, Any], **more: Any) -> httpx.Response:
    """A lease message as the operator posts it, numbered above the last (unless `seq` says otherwise)."""
    epoch = metric_value(http.get("/metrics").text, "tally_start_time_seconds")
    message = {"epoch": epoch, "count": "total", "tenants": tenants, "seq": next(SEQ), **more}
    raw = json.dumps(message, sort_keys=True).encode()
    return http.post("/internal/budgets", content=raw,
                     headers={"X-Tally-Signature": base64.b64encode(key.sign(raw)).decode()})


def public(key: Ed25519PrivateKey) -> str:
    return base64.b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def call(url: str, tenant: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120) as http:
        return http.post("/v1/completions", json=body, headers={"X-Tally-Tenant": tenant})


def test_exactly_the_requests_a_budget_covers_are_served_and_the_spend_is_the_engines(tmp_path: Path) -> None:
    """100 concurrent requests of one tenant, a budget that covers 10: those 10 are served, 90 get the OpenAI
    429 before anything is generated, the tenant's spend is what its clients were told and never more than
    the budget; another tenant is unaffected; an aborted request returns what it did not use."""
    operator = Ed25519PrivateKey.generate()
    # a request with no lease waits the queue's time for one (15 s here, 60 by default) before its 429
    with runtime_process(tmp_path / "rt.log", "--budgets", "--final-read-key", public(operator),
                         "--max-concurrent-generations", "4", "--max-queue-seconds", "15") as (_, url), \
            httpx.Client(base_url=url, timeout=60) as http:
        refused = call(url, "acme", PROMPT)
        assert refused.status_code == 429 and refused.headers["retry-after"]  # no lease yet: nothing is spent
        forged = http.post("/internal/budgets", json={"epoch": 1, "tenants": {"acme": {"allowance": 1e9}}})
        assert forged.status_code == 403
        assert post_leases(http, operator, {"probe": {"allowance": 1_000}}).status_code == 200
        probe = call(url, "probe", PROMPT).json()["usage"]
        cost = probe["prompt_tokens"] + probe["completion_tokens"]  # what each request reserves and bills
        # the whole budget leased to this pod: nothing more to ask for (the operator says so: unspent)
        assert post_leases(http, operator, {"acme": {"allowance": 10 * cost, "unspent": 10 * cost},
                                            "probe": {"allowance": 1_000}},
                           starter={"allowance": 10 * cost}).status_code == 200

        with concurrent.futures.ThreadPoolExecutor(100) as pool:
            replies = list(pool.map(lambda _: call(url, "acme", PROMPT), range(100)))
        served = [r for r in replies if r.status_code == 200]
        refusals = [r for r in replies if r.status_code != 200]
        assert len(served) == 10
        assert {r.status_code for r in refusals} == {429}
        error = refusals[0].json()["error"]
        assert error["code"] == "insufficient_quota" and error["type"] == "insufficient_quota"
        assert refusals[0].headers["x-ratelimit-remaining-tokens"] == "0" and refusals[0].headers["retry-after"]
        assert refusals[0].headers["x-ratelimit-limit-tokens"] == str(10 * cost)
        spent = sum(r.json()["usage"]["total_tokens"] for r in served)
        metrics = http.get("/metrics").text
        booked = sum(metric_value(metrics, f"tally_tenant_{f}_total", {"tenant": "acme"})
                     for f in ("prompt_tokens", "completion_tokens"))
        assert spent == booked == 10 * cost  # the engine's count, never more than the budget
        assert metric_value(metrics, "tally_requests_total", {"outcome": "over_budget"}) == 90
        assert metric_value(metrics, "tally_budget_refusals_total",
                            {"tenant": "acme", "code": "insufficient_quota"}) == 90
        assert metric_value(metrics, "tally_budget_remaining_tokens", {"tenant": "acme"}) == 0
        assert call(url, "zeta", PROMPT).status_code == 200  # a tenant not listed: the starter allowance

        # An aborted stream returns the reservation it did not use
        long = {"prompt": "Count:", "max_tokens": 300, "ignore_eos": True, "stream": True}
        assert post_leases(http, operator, {"acme": {"allowance": 10 * cost + 400}}).status_code == 200
        before = metric_value(http.get("/metrics").text, "tally_budget_remaining_tokens", {"tenant": "acme"})
        with httpx.Client(base_url=url, timeout=60) as client, \
                client.stream("POST", "/v1/completions", json=long, headers={"X-Tally-Tenant": "acme"}) as stream:
            next(stream.iter_bytes())
            during = metric_value(http.get("/metrics").text, "tally_budget_remaining_tokens", {"tenant": "acme"})

        def back() -> bool:
            text = http.get("/metrics").text
            used = sum(metric_value(text, f"tally_tenant_{f}_total", {"tenant": "acme"})
                       for f in ("prompt_tokens", "completion_tokens")) - 10 * cost
            left = metric_value(text, "tally_budget_remaining_tokens", {"tenant": "acme"})
            return left == before - used and 0 < used < 300

        assert before == 400 and during < 400 - 300
        assert until(back, 30), "the aborted stream's unused reservation did not come back"


def test_a_tenant_without_a_lease_asks_for_one(tmp_path: Path) -> None:
    """With a default budget, a tenant the lease message does not list is refused and asked for on /metrics,
    which the operator reads; once a lease names it, its retry fits."""
    operator = Ed25519PrivateKey.generate()
    with runtime_process(tmp_path / "rt.log", "--budgets", "--final-read-key", public(operator),
                         "--max-queue-seconds", "5") as (_, url), \
            httpx.Client(base_url=url, timeout=60) as http:
        assert post_leases(http, operator, {}, starter={"allowance": 0}).status_code == 200
        refused = call(url, "newbie", PROMPT)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert metric_value(http.get("/metrics").text, "tally_budget_wanted_tokens", {"tenant": "newbie"}) > 0
        assert post_leases(http, operator, {"newbie": {"allowance": 1000}}, starter={"allowance": 0}).status_code == 200
        assert "tally_budget_wanted_tokens{" not in http.get("/metrics").text
        assert call(url, "newbie", PROMPT).status_code == 200


def test_leases_are_taken_on_the_metrics_port_only(tmp_path: Path) -> None:
    """Where the operator reaches the pod (and the NetworkPolicy admits only it); the API port says 404."""
    operator = Ed25519PrivateKey.generate()
    metrics_port = free_port()
    with runtime_process(tmp_path / "rt.log", "--budgets", "--final-read-key", public(operator),
                         "--metrics-port", str(metrics_port)) as (_, url), \
            httpx.Client(base_url=f"http://127.0.0.1:{metrics_port}", timeout=60) as metrics, \
            httpx.Client(base_url=url, timeout=60) as api:
        assert post_leases(metrics, operator, {}).status_code == 200
        epoch = metric_value(metrics.get("/metrics").text, "tally_start_time_seconds")
        assert api.post("/internal/budgets", json={"epoch": epoch, "tenants": {}}).status_code == 404
        assert call(url, "anyone", PROMPT).status_code == 200  # no default budget: not listed is unlimited


def test_reservations_all_come_back_when_clients_leave_while_queued_granted_or_streaming(tmp_path: Path) -> None:
    """One generation slot, a queue behind it: clients that leave while queued, just as they are granted, and
    mid-stream. Afterwards nothing is held: the tenant's remaining allowance is its lease less exactly what
    its clients were billed (what the counter says), whatever the interleaving."""
    operator = Ed25519PrivateKey.generate()
    with runtime_process(tmp_path / "rt.log", "--budgets", "--final-read-key", public(operator),
                         "--max-concurrent-generations", "1") as (_, url), \
            httpx.Client(base_url=url, timeout=60) as http:
        assert post_leases(http, operator, {"acme": {"allowance": 1_000_000}}).status_code == 200
        body = {"prompt": "Count:", "max_tokens": 60, "ignore_eos": True, "stream": True}

        def leave_after(chunks: int, delay: float) -> None:
            with httpx.Client(base_url=url, timeout=60) as client:
                try:
                    with client.stream("POST", "/v1/completions", json=body, headers={"X-Tally-Tenant": "acme"},
                                       timeout=httpx.Timeout(60, read=delay)) as stream:
                        for i, _ in enumerate(stream.iter_bytes()):
                            if i + 1 >= chunks:
                                return
                except httpx.ReadTimeout:
                    return  # left while queued (no byte within `delay`)

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            list(pool.map(lambda args: leave_after(*args),
                          [(1, 0.05), (3, 5.0), (1, 0.2), (100, 30.0), (1, 0.01), (2, 5.0)] * 2))

        def settled() -> bool:
            text = http.get("/metrics").text
            billed = sum(metric_value(text, f"tally_tenant_{f}_total", {"tenant": "acme"})
                         for f in ("prompt_tokens", "completion_tokens"))
            return metric_value(text, "tally_inflight_generations") == 0 and \
                metric_value(text, "tally_budget_remaining_tokens", {"tenant": "acme"}) == 1_000_000 - billed
        assert until(settled, 60), "a reservation was kept after its request ended"


def test_a_lowered_allowance_keeps_what_was_admitted_and_a_late_message_changes_nothing(tmp_path: Path) -> None:
    """The operator takes back an allowance while a request admitted under it streams: the stream finishes,
    nothing new is admitted, and /metrics say the pod may still reach its counter plus that reservation
    (what the operator counts until the stream ends), under the message's number. A message numbered below
    it (late, from an earlier round) is refused with 409 and changes nothing."""
    operator = Ed25519PrivateKey.generate()
    with runtime_process(tmp_path / "rt.log", "--budgets", "--final-read-key", public(operator),
                         "--max-queue-seconds", "5") as (_, url), \
            httpx.Client(base_url=url, timeout=60) as http:
        assert post_leases(http, operator, {"acme": {"allowance": 100_000}}).status_code == 200
        body = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=url, timeout=120) as client, \
                client.stream("POST", "/v1/completions", json=body, headers={"X-Tally-Tenant": "acme"}) as stream:
            chunks = stream.iter_bytes()
            received = [next(chunks)]
            lowered = post_leases(http, operator, {"acme": {"allowance": 0, "unspent": 50_000}}, seq=10**6)
            assert lowered.status_code == 200 and lowered.json()["seq"] == 10**6
            text = http.get("/metrics").text
            reach = metric_value(text, "tally_budget_allowance_tokens", {"tenant": "acme"})
            assert metric_value(text, "tally_budget_lease_sequence") == 10**6
            assert reach >= 200  # its reservation: prompt and 200 tokens, not yet billed
            late = post_leases(http, operator, {"acme": {"allowance": 100_000}}, seq=10**6 - 1)
            assert late.status_code == 409 and late.json()["error"]["code"] == "stale_lease"
            refused = call(url, "acme", PROMPT)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
            received.extend(chunks)
        billed = sse_payloads(b"".join(received))[-2]["usage"]["total_tokens"]

        def settled() -> bool:  # what it may reach is what it spent: nothing in flight, allowance 0
            return metric_value(http.get("/metrics").text, "tally_budget_allowance_tokens", {"tenant": "acme"}) \
                == billed
        assert until(settled, 30), "the pod's reach did not come down to its counter once the stream ended"
        assert billed <= reach


def test_a_tenant_this_replica_cannot_count_apart_is_refused_never_billed_to_other(tmp_path: Path) -> None:
    """Past `--max-tenants` a tenant was counted under `other`, which no lease message lists: a listed tenant with
    a 60-token budget was served 136. With budgets, a tenant this replica cannot count apart is refused now
    (insufficient_quota, saying why), whatever its lease says; the tenants it counts are served as before."""
    operator = Ed25519PrivateKey.generate()
    with runtime_process(tmp_path / "rt.log", "--budgets", "--final-read-key", public(operator),
                         "--max-tenants", "2") as (_, url), httpx.Client(base_url=url, timeout=60) as http:
        assert post_leases(http, operator, {name: {"allowance": 100_000} for name in ("a", "b", "late")},
                           starter={"allowance": None}).status_code == 200
        assert call(url, "a", PROMPT).status_code == 200 and call(url, "b", PROMPT).status_code == 200
        refused = call(url, "late", PROMPT)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota"
        assert "cannot be tracked" in refused.json()["error"]["message"]
        unlisted = call(url, "someone-else", PROMPT)  # no budget of its own (starter: none), still uncountable
        assert unlisted.status_code == 429 and unlisted.json()["error"]["code"] == "insufficient_quota"


def test_new_tenants_admitted_at_once_past_the_bound_are_refused_and_none_is_billed_to_other(tmp_path: Path) -> None:
    """Six new tenants' first requests at once with room for two labels: each found the last label free when it
    was admitted and the later ones were recorded under `other`, which no lease lists (`other` spent 64 against an
    allowance of 20). Now a label is held from admission: two are served, four refused, nothing under `other`."""
    operator = Ed25519PrivateKey.generate()
    names = [f"new-{i}" for i in range(6)]
    with runtime_process(tmp_path / "rt.log", "--budgets", "--final-read-key", public(operator),
                         "--max-tenants", "2") as (_, url), httpx.Client(base_url=url, timeout=60) as http:
        assert post_leases(http, operator, {name: {"allowance": 100_000} for name in names},
                           starter={"allowance": None}).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            answers = list(pool.map(lambda name: call(url, name, {**PROMPT, "max_tokens": 24}), names))
        codes = sorted(answer.status_code for answer in answers)
        assert codes == [200, 200, 429, 429, 429, 429], codes
        assert all(a.json()["error"]["code"] == "insufficient_quota" for a in answers if a.status_code == 429)
        text = http.get("/metrics").text
        assert metric_value(text, "tally_tenant_overflow_requests_total") == 0
        assert metric_value(text, "tally_tenant_requests_total", {"tenant": "other"}) == 0


def test_a_responses_request_reserves_its_max_output_tokens_against_the_tenants_budget(tmp_path: Path) -> None:
    """/v1/responses goes through the same budgets as chat: its worst case (input + max_output_tokens) is
    reserved; one that fits what the tenant has left is served and settles to the engine's count, one that
    does not is the 429 `insufficient_quota` before anything is generated."""
    operator = Ed25519PrivateKey.generate()
    with runtime_process(tmp_path / "rt.log", "--budgets", "--final-read-key", public(operator)) as (_, url), \
            httpx.Client(base_url=url, timeout=120) as http:
        assert post_leases(http, operator, {"acme": {"allowance": 300, "unspent": 300}}).status_code == 200
        body = {"input": "Say something:", "max_output_tokens": 8, "ignore_eos": True}
        served = http.post("/v1/responses", json=body, headers={"X-Tally-Tenant": "acme"})
        assert served.status_code == 200, served.text
        spent = served.json()["usage"]["total_tokens"]
        too_much = http.post("/v1/responses", json={**body, "max_output_tokens": 300},
                             headers={"X-Tally-Tenant": "acme"})
        assert too_much.status_code == 429 and too_much.json()["error"]["code"] == "insufficient_quota"
        metrics = http.get("/metrics").text
        booked = sum(metric_value(metrics, f"tally_tenant_{f}_total", {"tenant": "acme"})
                     for f in ("prompt_tokens", "completion_tokens"))
        assert booked == spent and metric_value(metrics, "tally_budget_remaining_tokens", {"tenant": "acme"}) == \
            300 - spent

"""The runtime's leases (budgets.py) between two lease messages: what a refusal asks for, which refusal a
client gets, and which messages are applied."""

from __future__ import annotations

from typing import Any

import pytest

from tally_runtime.budgets import QUOTA_CODE, RATE_CODE, Budgets, NeedsAllowance, StaleLease
from tally_runtime.protocol import ApiError

EPOCH = 100.0


def budgets() -> tuple[Budgets, dict[str, float]]:
    counters: dict[str, float] = {}
    return Budgets(counter=lambda tenant: counters.get(tenant, 0.0)), counters


def message(seq: int, tenants: dict[str, Any], starter: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"epoch": EPOCH, "seq": seq, "count": "total", "tenants": tenants, "starter": starter or {}}


async def until(condition: Any, seconds: float = 5.0) -> None:
    """Poll the loop until `condition()` holds (waiters resume over a few turns), failing at the deadline."""
    import asyncio
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.005)


WAIT = "wait"  # the request fits what the tenant has left: it may wait for allowance here (it asked)


def refusal(b: Budgets, tenant: str, tokens: float) -> str:
    try:
        b.reserve(tenant, tokens)
    except NeedsAllowance:
        return WAIT
    except ApiError as error:
        assert error.status == 429
        return str(error.code)
    raise AssertionError("reserved")


def test_an_ask_made_after_the_operators_read_survives_its_message() -> None:
    """The operator read /metrics, then a tenant was refused and asked, then the message of that round came:
    it does not lease the tenant, so the ask stays for the next round to answer."""
    b, _ = budgets()
    b.apply(message(1, {"acme": {"allowance": 0, "unspent": 1000}}, {"allowance": 0}), EPOCH)
    assert refusal(b, "acme", 10) == WAIT and refusal(b, "newbie", 10) == WAIT
    assert b.asking() == {"acme": 10, "newbie": 10}
    b.apply(message(2, {"acme": {"allowance": 0, "unspent": 1000}}, {"allowance": 0}), EPOCH)
    assert b.asking() == {"acme": 10, "newbie": 10}  # not answered: still asked for
    b.apply(message(3, {"acme": {"allowance": 500, "unspent": 1000}}, {"allowance": 0}), EPOCH)
    assert b.asking() == {"newbie": 10}  # acme has something to spend here now
    b.reserve("acme", 10)


def test_quota_only_when_the_request_does_not_fit_what_the_tenant_has_left_anywhere() -> None:
    b, counters = budgets()
    b.apply(message(1, {"acme": {"allowance": 100, "unspent": 300}}), EPOCH)
    first = b.reserve("acme", 100)
    assert refusal(b, "acme", 50) == WAIT  # another pod may have the rest: it waits, and this pod asks
    counters["acme"] = 90  # the first request billed 90 of its 100
    b.settle(first, 90)
    assert refusal(b, "acme", 250) == QUOTA_CODE  # 300 - 90 spent here since: 210 left at most, anywhere
    assert refusal(b, "acme", 200) == WAIT


def test_messages_apply_in_order_only_and_a_lower_allowance_keeps_what_was_admitted() -> None:
    b, _ = budgets()
    b.apply(message(5, {"acme": {"allowance": 1000}}), EPOCH)
    held = b.reserve("acme", 600)
    b.apply(message(6, {"acme": {"allowance": 100}}), EPOCH)
    assert b.reach("acme") == 600 and b.remaining("acme") == 0  # admitted: still may be spent
    with pytest.raises(StaleLease):
        b.apply(message(6, {"acme": {"allowance": 5000}}), EPOCH)
    with pytest.raises(StaleLease):
        b.apply(message(4, {"acme": {"allowance": 5000}}), EPOCH)
    assert b.seq == 6 and b.lease("acme").allowance == 100
    b.settle(held, 0)
    assert b.reach("acme") == 100
    for bad in ({"seq": None}, {"seq": 0}, {"seq": True}, {"seq": 2**63}, {"epoch": 1.0}):
        with pytest.raises(ValueError):
            b.apply({**message(7, {}), **bad}, EPOCH)
    assert b.seq == 6


async def test_a_request_that_fits_the_budget_waits_for_allowance_and_is_served_in_arrival_order() -> None:
    """Refused `rate_limit_exceeded` at once, clients retrying 20 times spent 68 % of a budget, and with the SDK's
    defaults none was served: a request that fits what its tenant has left now waits while the pod asks, the
    long-poll hears of it at once, and the next lease message serves the waiters first come, first served."""
    import asyncio

    b, _ = budgets()
    b.apply(message(1, {"acme": {"allowance": 100, "unspent": 1000}}), EPOCH)
    held = b.reserve("acme", 100)
    served: list[int] = []

    async def request(i: int) -> None:
        await b.acquire("acme", 100, wait_seconds=30)
        served.append(i)

    waiters = [asyncio.create_task(request(i)) for i in range(3)]
    await asyncio.wait_for(b.wait_for_asks(30), 5)  # the operator's long-poll answers at once
    assert b.asking() == {"acme": 300}  # what the three waiting requests need together
    b.apply(message(2, {"acme": {"allowance": 300, "unspent": 1000}}), EPOCH)  # room for two more
    await until(lambda: served == [0, 1] and b.waiting == {"acme": 100})  # the third waits on
    assert not waiters[2].done()
    b.settle(held, 100)
    b.apply(message(3, {"acme": {"allowance": 500, "unspent": 900}}), EPOCH)
    await asyncio.wait_for(waiters[2], 5)
    assert served == [0, 1, 2] and b.asking() == {}


async def test_a_wait_ends_with_rate_limit_exceeded_only_when_no_allowance_came_in_time() -> None:
    import asyncio

    b, _ = budgets()
    b.apply(message(1, {"acme": {"allowance": 0, "unspent": 1000}}), EPOCH)
    with pytest.raises(ApiError) as caught:
        await b.acquire("acme", 10, wait_seconds=0.2)
    assert caught.value.status == 429 and caught.value.code == RATE_CODE
    assert b.waiting == {}  # the request's demand left with it
    assert b.asking() == {"acme": 10}  # the next scrape still leases for it (the client may retry)
    with pytest.raises(TimeoutError):  # but nothing waits: the long-poll does not call a round at once
        await asyncio.wait_for(b.wait_for_asks(30), 0.3)


async def test_before_the_first_lease_a_request_waits_and_a_drain_ends_the_wait() -> None:
    import asyncio

    b, _ = budgets()
    waiting = asyncio.create_task(b.acquire("acme", 10, wait_seconds=30))
    await asyncio.wait_for(b.wait_for_asks(30), 5)
    b.close()
    with pytest.raises(ApiError) as caught:
        await asyncio.wait_for(waiting, 5)
    assert caught.value.status == 503 and caught.value.code == "shutting_down"


def test_insufficient_quota_tells_the_sdks_not_to_retry() -> None:
    b, _ = budgets()
    b.apply(message(1, {"acme": {"allowance": 10, "unspent": 10}}), EPOCH)
    with pytest.raises(ApiError) as caught:
        b.reserve("acme", 11)
    assert caught.value.code == QUOTA_CODE and caught.value.headers is not None
    assert caught.value.headers["x-should-retry"] == "false"


def test_credits_weigh_each_kind_of_token_and_a_reservation_takes_the_dearer_prompt_weight() -> None:
    from tally_runtime.budgets import reservation_tokens
    from tally_runtime.units import Weights

    b, _ = budgets()
    b.apply({**message(1, {}), "count": "credits", "weights": {"prompt": 2, "cachedPrompt": 1, "completion": 5}},
            EPOCH)
    assert b.weights == Weights(2, 1, 5)
    assert b.weights.of(prompt=100, cached=40, completion=10) == 2 * 60 + 1 * 40 + 5 * 10
    assert reservation_tokens([100], 2, 10, b.weights) == 2 * (100 * 2) + 2 * 10 * 5
    for weights in (None, {"prompt": 1, "cachedPrompt": 1}, {"prompt": -1, "cachedPrompt": 0, "completion": 1},
                    {"prompt": 1.5, "cachedPrompt": 0, "completion": 1}, {"prompt": True, "cachedPrompt": 0,
                                                                            "completion": 1},
                    {"prompt": 10**7, "cachedPrompt": 0, "completion": 1}):
        with pytest.raises(ValueError):
            b.apply({**message(2, {}), "count": "credits", "weights": weights}, EPOCH)
    with pytest.raises(ValueError):
        b.apply({**message(2, {}), "count": "dollars"}, EPOCH)
    assert b.weights == Weights(2, 1, 5) and b.seq == 1  # a refused message changed nothing


def test_what_a_message_said_is_left_is_not_held_against_a_request_once_its_month_has_ended() -> None:
    """A request at 00:00:05 on the 1st, before the operator's first round of the month, was refused
    `insufficient_quota` on the month before's `unspent`; now it asks, and waits for the new month's lease."""
    import time

    b, _ = budgets()
    b.apply({**message(1, {"acme": {"allowance": 0, "unspent": 0}}), "periodEnd": time.time() + 3600}, EPOCH)
    assert refusal(b, "acme", 10) == QUOTA_CODE
    b.apply({**message(2, {"acme": {"allowance": 0, "unspent": 0}}), "periodEnd": time.time() - 1}, EPOCH)
    assert refusal(b, "acme", 10) == WAIT


async def test_a_request_that_fits_once_this_pods_requests_in_flight_end_waits_for_them() -> None:
    """A request larger than what its tenant has left now, but not once the requests in flight here give back what
    they reserved and did not spend, was refused `insufficient_quota` (which the SDK never retries) though it would
    fit a moment later: it waits for them, is served when they end, and is refused only if it still does not fit."""
    import asyncio

    b, counters = budgets()
    b.apply(message(1, {"acme": {"allowance": 300, "unspent": 300}}), EPOCH)
    first = b.reserve("acme", 200)
    waiting = asyncio.create_task(b.acquire("acme", 200, wait_seconds=30))
    await until(lambda: b.waiting == {"acme": 200})  # 100 left now; 300 if the first spent nothing
    counters["acme"] = 60  # the first stopped early: 140 of its 200 come back
    b.settle(first, 60)
    second = await asyncio.wait_for(waiting, 5)  # no lease message came: 300 - 60 left, enough
    late = asyncio.create_task(b.acquire("acme", 100, wait_seconds=30))
    await until(lambda: b.waiting == {"acme": 100})  # 40 left now, 240 at most once the second ends
    counters["acme"] = 260  # the second spent all it reserved
    b.settle(second, 200)
    with pytest.raises(ApiError) as caught:
        await asyncio.wait_for(late, 5)  # at once, not at the wait's end
    assert caught.value.code == QUOTA_CODE and b.waiting == {} and not b._settled

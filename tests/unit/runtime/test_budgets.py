"""The runtime's leases (budgets.py) between two lease messages: what a refusal asks for, which refusal a
client gets, and which messages are applied."""

from __future__ import annotations

from typing import Any

import pytest

from tally_runtime.budgets import QUOTA_CODE, RATE_CODE, Budgets, StaleLease
from tally_runtime.protocol import ApiError

EPOCH = 100.0


def budgets() -> tuple[Budgets, dict[str, float]]:
    counters: dict[str, float] = {}
    return Budgets(counter=lambda tenant: counters.get(tenant, 0.0)), counters


def message(seq: int, tenants: dict[str, Any], starter: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"epoch": EPOCH, "seq": seq, "count": "total", "tenants": tenants, "starter": starter or {}}


def refusal(b: Budgets, tenant: str, tokens: float) -> str:
    with pytest.raises(ApiError) as caught:
        b.reserve(tenant, tokens)
    assert caught.value.status == 429
    return str(caught.value.code)


def test_an_ask_made_after_the_operators_read_survives_its_message() -> None:
    """The operator read /metrics, then a tenant was refused and asked, then the message of that round came:
    it does not lease the tenant, so the ask stays for the next round to answer."""
    b, _ = budgets()
    b.apply(message(1, {"acme": {"allowance": 0, "unspent": 1000}}, {"allowance": 0}), EPOCH)
    assert refusal(b, "acme", 10) == RATE_CODE and refusal(b, "newbie", 10) == RATE_CODE
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
    assert refusal(b, "acme", 50) == RATE_CODE  # another pod may have the rest: retry, and this pod asks
    counters["acme"] = 90  # the first request billed 90 of its 100
    b.settle(first, 90)
    assert refusal(b, "acme", 250) == QUOTA_CODE  # 300 - 90 spent here since: 210 left at most, anywhere
    assert refusal(b, "acme", 200) == RATE_CODE


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

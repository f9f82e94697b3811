"""A Budget's edit wakes its round at once (issue 60: a raise reached the services after 5.2 s, the round's own
turn, while their pods answered `insufficient_quota` and asked for nothing). The index handler kopf calls on
every Budget event is what sees the edit; a status write (the round's own, every turn) must not wake it again."""

from __future__ import annotations

from typing import Any

import kopf
from money_world import SIGNER

from tally_operator import handlers
from tally_operator.context import Context
from tally_operator.settings import OperatorSettings


def seen(memo: kopf.Memo, generation: int, status: dict[str, Any] | None = None) -> None:
    body = kopf.Body({"metadata": {"name": "acme-month", "uid": "b-1", "generation": generation},
                      "spec": {"tenants": [{"name": "acme", "monthly": 3000}]}, "status": status or {}})
    handlers.budget_index(body=body, name="acme-month", memo=memo)


def test_an_edited_budget_wakes_its_round_and_its_own_status_writes_do_not() -> None:
    context = Context(OperatorSettings(), None, None, SIGNER)  # type: ignore[arg-type]
    memo = kopf.Memo(context=context)
    woken = context.wakeup(("Budget", "acme-month"))
    seen(memo, 1)
    assert woken.is_set()  # first seen (the operator started, or the Budget was created)
    woken.clear()
    seen(memo, 1, {"seq": 7})  # the round wrote its status: same spec
    assert not woken.is_set()
    seen(memo, 2)  # kubectl edit: a raise
    assert woken.is_set()

"""What ends the operator's long-poll of a pod's budget asks (asks.py): a request waiting there, or a pod
waiting for its first lease; never an answer it cannot read."""

from __future__ import annotations

import json

from tally_operator.asks import asking


def test_a_waiting_request_or_a_pod_without_its_first_lease_calls_a_round() -> None:
    assert asking(json.dumps({"leased": True, "waiting": {"acme": 90}, "asks": {"acme": 90}}))
    assert asking(json.dumps({"leased": False, "waiting": {}, "asks": {}}))


def test_an_old_ask_or_an_unreadable_answer_does_not() -> None:
    assert not asking(json.dumps({"leased": True, "waiting": {}, "asks": {"acme": 90}}))  # its request gave up
    for text in ("", "[]", "null", '{"waiting": []}', '{"leased": "no"}', "[" * 100_000):
        assert not asking(text)

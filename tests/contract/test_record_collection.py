"""The platform's record delivery: a real `tally-runtime serve --usage-records-pull` keeps its records for the
operator, whose collector (operator/tally_operator/collector.py) forwards them to the billing system with the
platform's token and only then acknowledges them. The receiver is down for a while (nothing is lost, nothing
acknowledged), a line written into the spool by something else is never forwarded, and a restarted runtime's
earlier records are forwarded marked as such. The receiver holds exactly what the clients were told."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from records_harness import TOKEN, Receiver, serve, told
from runtime_harness import metric_value, runtime_process

from tally_operator.collector import Forwarder, collect
from tally_operator.settings import OperatorSettings
from tally_operator.signing import Signer

SOURCE = "/namespaces/team/completionservices/chat/pods/chat-0"
META = {"namespace": "team", "name": "chat"}


def forwarder(tmp_path: Path, url: str) -> Forwarder:
    token = tmp_path / "platform-token"
    token.write_text(TOKEN)
    return Forwarder(OperatorSettings(records_url=url, records_token_file=str(token)))


def test_the_operator_forwards_what_the_pods_kept_and_only_then_they_reclaim_it(tmp_path: Path,
                                                                                 receiver: Receiver) -> None:
    signer = Signer.load("")
    flags = ("--usage-records-pull", "--usage-records-spool", str(tmp_path / "spool"), "--usage-source", SOURCE,
             "--final-read-key", signer.public_key, "--pod-uid", "pod-a")

    def round_(url: str) -> dict[str, int]:
        return asyncio.run(collect(forwarder(tmp_path, receiver.url), signer, 10.0, META, {"pod-a": url}))

    with runtime_process(tmp_path / "first.log", *flags) as (proc, url):
        receiver.failing = True
        sent = serve(url, 3)
        assert round_(url) == {}  # the billing system is down: nothing acknowledged, the pod keeps them
        assert metric_value(httpx.get(f"{url}/metrics").text, "tally_usage_records_queued") == 3
        receiver.failing = False
        assert round_(url) == {"pod-a": 3} and receiver.usage() == told(sent)
        assert metric_value(httpx.get(f"{url}/metrics").text, "tally_usage_records_queued") == 0
        sent += serve(url, 2)
        spool = tmp_path / "spool"
        newest = max(spool.glob("*.seg"))
        with newest.open("ab") as f:  # someone with the pod's volume adds a record of their own
            f.write(b"0" * 32 + b' {"id":"forged","source":"' + SOURCE.encode() + b'","data":{"prompt_tokens":9}}\n')
        sent += serve(url, 1)  # spooled after it
        assert round_(url) == {"pod-a": 3}
        assert "forged" not in receiver.events and receiver.usage() == told(sent)
        assert metric_value(httpx.get(f"{url}/metrics").text, "tally_usage_records_refused_total") == 1
        sent += serve(url, 1)
        proc.kill()  # with one record not yet collected
        proc.wait(timeout=30)
    with runtime_process(tmp_path / "second.log", *flags) as (_, url):
        assert round_(url) == {"pod-a": 1}  # from before the restart: forwarded, though it cannot be vouched for
        assert receiver.usage() == told(sent)


def test_records_of_another_service_are_not_forwarded() -> None:
    from tally_operator.collector import forwardable

    answer = {"records": [{"event": {"id": "a", "source": SOURCE}, "verified": True},
                          {"event": {"id": "b", "source": "/namespaces/other/completionservices/x/pods/y"},
                           "verified": True},
                          {"event": {"source": SOURCE}, "verified": True}, "junk"]}
    events, foreign = forwardable(answer, "team", "chat")
    assert [e["id"] for e in events] == ["a"] and foreign == 3


def test_an_unverified_record_is_forwarded_only_if_it_could_be_this_services() -> None:
    """Issue 61, item 2: after two SIGTERMs from a shell in the pod, lines appended to the spool came back as
    `verified: false` and were forwarded with the platform's token because their `source` was the pod's: one
    named another team's namespace, others -5,000,000 and +9,000,000,000 completion tokens. An unverified event
    (a restarted runtime's earlier records are, too) must read as a record of this service could."""
    from tally_operator.collector import forwardable

    def record(event_id: str, **data: Any) -> dict[str, Any]:
        body = {"namespace": "team", "service": "chat", "tenant": "acme", "prompt_tokens": 10,
                "completion_tokens": 5, "cached_tokens": 2, "reasoning_tokens": 0, **data}
        return {"event": {"id": event_id, "source": SOURCE, "subject": body["tenant"], "data": body},
                "verified": False}

    forged = [record("other-team", namespace="team-b"), record("minus", completion_tokens=-5_000_000),
              record("huge", completion_tokens=9_000_000_000), record("float", prompt_tokens=1.5),
              record("more-cached", cached_tokens=11), {**record("subject"), "event": {
                  **record("subject")["event"], "subject": "someone-else"}}]
    legit = [record("ok"), record("older", namespace="", service="")]  # records from before those fields
    events, left_out = forwardable({"records": [*forged, *legit]}, "team", "chat")
    assert [e["id"] for e in events] == ["ok", "older"] and left_out == len(forged)


def test_the_operator_reaches_a_billing_system_behind_a_private_ca_and_through_a_proxy(tmp_path: Path,
                                                                                      receiver: Receiver) -> None:
    """The platform's CAs (usageRecords.caBundle) and proxy (usageRecords.proxy) are the operator's forwarder's."""
    import ssl

    from records_harness import Proxy, private_ca

    proxy = Proxy()
    try:
        token = tmp_path / "platform-token"
        token.write_text(TOKEN)
        via_proxy = Forwarder(OperatorSettings(records_url=receiver.url, records_token_file=str(token),
                                               records_proxy=proxy.url))
        asyncio.run(via_proxy.send([{"id": "p1", "source": SOURCE, "data": {"prompt_tokens": 1,
                                                                              "completion_tokens": 1}}]))
        assert "p1" in receiver.events and proxy.forwarded == 1
    finally:
        proxy.server.shutdown()
    ca, cert, key = private_ca(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    receiver.server.socket = context.wrap_socket(receiver.server.socket, server_side=True)
    url = receiver.url.replace("http://", "https://")
    untrusting = Forwarder(OperatorSettings(records_url=url, records_token_file=str(token)))
    with pytest.raises(httpx.ConnectError):
        asyncio.run(untrusting.send([{"id": "t0", "source": SOURCE}]))
    trusting = Forwarder(OperatorSettings(records_url=url, records_token_file=str(token), records_ca=ca.read_text()))
    asyncio.run(trusting.send([{"id": "t1", "source": SOURCE, "data": {"prompt_tokens": 1, "completion_tokens": 1}}]))
    assert "t1" in receiver.events and "t0" not in receiver.events


async def test_a_ca_bundle_that_is_not_pem_fails_delivery_alone_and_a_rotated_token_is_read_again(
        tmp_path: Path) -> None:
    """A CA bundle that is not PEM kept the operator from starting (no service booked, its health never
    answering); now delivery alone fails, saying why. The token was read once: a rotated Secret got 401s until the
    operator restarted; now it is read again when its file changes."""
    token = tmp_path / "token"
    token.write_text("first\n")
    broken = Forwarder(OperatorSettings(records_url="https://meter.invalid/api/v1/events", records_ca="not a pem",
                                        records_token_file=str(token)))
    with pytest.raises(RuntimeError, match="caBundle is not PEM"):
        await broken.send([{"id": "e1"}])
    forwarder = Forwarder(OperatorSettings(records_url="https://meter.invalid/api/v1/events",
                                           records_token_file=str(token)))
    assert forwarder.headers["Authorization"] == "Bearer first"
    rotated = tmp_path / "rotated"  # as the kubelet updates a mounted Secret: a new file swapped in
    rotated.write_text("second\n")
    os.replace(rotated, token)
    assert forwarder.headers["Authorization"] == "Bearer second"

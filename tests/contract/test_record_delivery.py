"""Usage records delivered to a billing system (delivery.py) by real `tally-runtime serve` processes: a
receiver that fails, a runtime SIGKILLed with records spooled, a drain that flushes. At least once: the
receiver deduplicates by event id, as OpenMeter does, and then holds exactly what the clients were told."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
from records_harness import TOKEN, Proxy, Receiver, private_ca, serve, told
from runtime_harness import metric_value, runtime_process, until


def test_records_reach_the_receiver_exactly_once_through_failures_a_crash_and_a_drain(
        tmp_path: Path, receiver: Receiver) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    flags = ("--usage-records-url", receiver.url, "--usage-records-token-file", str(token), "--journal-path",
             str(tmp_path / "ledger" / "usage.json"), "--usage-source", "/namespaces/a/completionservices/s/pods/p")
    (tmp_path / "ledger").mkdir()
    sent: list[dict[str, int]] = []
    with runtime_process(tmp_path / "first.log", *flags) as (proc, url):
        receiver.failing = True  # the billing system is down: records wait in the spool, retried
        sent += serve(url, 4)
        assert until(lambda: receiver.posts >= 2, 30)
        assert metric_value(httpx.get(f"{url}/metrics").text, "tally_usage_records_queued") == 4
        proc.send_signal(signal.SIGKILL)  # with 4 records undelivered
        proc.wait(timeout=30)
    receiver.failing = False
    with runtime_process(tmp_path / "second.log", *flags) as (proc, url):
        assert until(lambda: receiver.usage() == told(sent), 30), (receiver.usage(), told(sent))
        sent += serve(url, 3)
        proc.send_signal(signal.SIGTERM)  # the drain delivers what is spooled before the pod goes
        assert proc.wait(timeout=60) == 0
    assert receiver.usage() == told(sent)
    event = next(iter(receiver.events.values()))
    assert event["type"] == "dev.tally.usage.v1" and event["source"] == "/namespaces/a/completionservices/s/pods/p"
    assert event["data"]["schema"] == "tally.usage.v1"


def test_a_spool_that_is_full_counts_what_it_cannot_hold_lost(tmp_path: Path, receiver: Receiver) -> None:
    receiver.failing = True
    with runtime_process(tmp_path / "rt.log", "--usage-records-url", receiver.url, "--usage-records-spool",
                         str(tmp_path / "spool"), "--usage-records-spool-bytes", "4096") as (proc, url):
        serve(url, 12)  # each record is about 600 bytes as a CloudEvent: 6 or so fit
        metrics = httpx.get(f"{url}/metrics").text
        queued = metric_value(metrics, "tally_usage_records_queued")
        lost = metric_value(metrics, "tally_usage_records_lost_total", {"sink": "delivery"})
        assert 0 < queued < 12 and queued + lost == 12
        proc.send_signal(signal.SIGKILL)  # a drain would retry the failing receiver until its time is up
        proc.wait(timeout=30)


def test_a_receiver_that_keeps_pace_loses_nothing_at_100_records_a_second(tmp_path: Path, receiver: Receiver) -> None:
    """The spool was reclaimed only once it was completely empty, which a steady stream never lets it be: at 100
    records/s with a 50 ms receiver, records were counted lost while nearly all of the spool was delivered.
    Here the bound holds about 100 records, and 1,000 come at 100 a second (the FastEngine: no model)."""
    from fast_engine import FastEngine
    from runtime_harness import serving

    from tally_runtime.app import create_app
    from tally_runtime.settings import Settings

    receiver.latency = 0.05
    token = tmp_path / "token"
    token.write_text(TOKEN)
    settings = Settings(engine="cpu", usage_records=False, usage_records_url=receiver.url,
                        usage_records_token_file=str(token), usage_records_spool=str(tmp_path / "spool"),
                        usage_records_spool_bytes=64 << 10, usage_source="/namespaces/a/completionservices/s/pods/p")
    app = create_app(settings, FastEngine(seconds_per_token=0.0))

    async def load(url: str) -> int:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async def one(i: int) -> int:
                await asyncio.sleep(i / 100)  # 100 a second
                reply = await http.post("/v1/completions", json={"prompt": f"Item {i}:", "max_tokens": 2})
                return reply.status_code

            return sum(code == 200 for code in await asyncio.gather(*(one(i) for i in range(1_000))))

    with serving(app) as url:
        served = asyncio.run(load(url))
        assert served == 1_000
        assert until(lambda: len(receiver.events) == 1_000, 60), len(receiver.events)
        metrics = httpx.get(f"{url}/metrics").text
        assert metric_value(metrics, "tally_usage_records_lost_total", {"sink": "delivery"}) == 0


def test_records_reach_a_receiver_whose_certificate_a_private_ca_signed(tmp_path: Path, receiver: Receiver) -> None:
    """The client trusted only the system's CAs: a receiver behind the platform's own PKI got nothing, retried for
    ever. With --usage-records-ca-file it is reached; without it, nothing is delivered and nothing is lost."""
    import ssl

    ca, cert, key = private_ca(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    receiver.server.socket = context.wrap_socket(receiver.server.socket, server_side=True)
    url = receiver.url.replace("http://", "https://")
    token = tmp_path / "token"
    token.write_text(TOKEN)
    flags = ("--usage-records-url", url, "--usage-records-token-file", str(token), "--usage-records-spool",
             str(tmp_path / "spool"))
    with runtime_process(tmp_path / "untrusting.log", *flags) as (proc, base):
        sent = serve(base, 2)
        assert until(lambda: "CERTIFICATE_VERIFY_FAILED" in (tmp_path / "untrusting.log").read_text(), 30)
        assert not receiver.events
        # killed, its records in the spool (a drain would try the receiver it cannot trust until its time is up)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    with runtime_process(tmp_path / "trusting.log", *flags, "--usage-records-ca-file", str(ca)) as (_, base):
        sent += serve(base, 1)
        assert until(lambda: receiver.usage() == told(sent), 30), (receiver.usage(), told(sent))


def test_records_reach_the_receiver_through_the_configured_proxy_only(tmp_path: Path, receiver: Receiver) -> None:
    """An egress proxy is configured explicitly (--usage-records-proxy): the pod's environment is its spec's, so
    HTTPS_PROXY there is not read (a service could otherwise send its records anywhere)."""
    proxy = Proxy()
    try:
        token = tmp_path / "token"
        token.write_text(TOKEN)
        with runtime_process(tmp_path / "rt.log", "--usage-records-url", receiver.url, "--usage-records-token-file",
                             str(token), "--usage-records-spool", str(tmp_path / "spool"),
                             "--usage-records-proxy", proxy.url) as (_, base):
            sent = serve(base, 2)
            assert until(lambda: receiver.usage() == told(sent), 30), (receiver.usage(), told(sent))
        assert proxy.forwarded >= 1
    finally:
        proxy.server.shutdown()

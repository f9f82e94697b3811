"""SIGTERM: stop admitting, let what is in flight finish, wait for the operator's final read, then exit.

The runtime owns the signal. SGLang installs its own SIGTERM handler on the serving loop the first time
it generates (SGLANG_CONTRACT.md §6) and would end the process while streams are still open, so this
handler is installed after the engine has started, replacing it. A second SIGTERM exits at once.

While draining, /health answers 503 (the pod leaves its Service), every response closes its connection
and idle keep-alive connections are closed at once (a pooled client, such as the `openai` SDK, would
otherwise keep sending to this pod on the connection it holds: the Service balances per connection), new
requests get 503 with Retry-After, and /metrics keeps answering. The pod's preStop pause (desired.py)
gives the Service time to stop sending new connections before the signal comes. In-flight requests get
`drain_seconds` to finish and be recorded; past that they are aborted in the engine, billed what it
generated, and recorded whatever their client's socket does. Then the runtime waits for the final-read
handshake: the operator reads /metrics, books those counters in the CompletionService's status, and then
posts them back to `POST /internal/final-read`, signed (handoff.py). Only a signed acknowledgement that
names this pod, this process's epoch and exactly its final counters ends the wait, so a Prometheus, a
curious client or a forger reading /metrics never makes the pod exit before its last counters were booked.
The wait lasts `final_read_seconds` plus whatever the drain left of `drain_seconds` (the pod's grace period
covers both): an operator that is away for minutes, restarting or waiting out a peering lease, still books
a pod that drained quickly. The operator may also release the wait (signed too): when its
CompletionService is deleted there is no ledger left to book into.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tally_runtime.ledger import Totals
from tally_runtime.serving import Server

if TYPE_CHECKING:
    from tally_runtime.collect import Collection
    from tally_runtime.delivery import Delivery
    from tally_runtime.http_limits import Connections

log = logging.getLogger("tally_runtime.drain")

ABORT_GRACE_SECONDS = 10.0  # after the deadline: for aborted runs to deliver their final counts
FLUSH_SECONDS = 10.0  # at least this long to deliver the spooled records, however late the drain ended


def final_counters(totals: Totals) -> dict[str, float]:
    """What an acknowledgement must match: the epoch and the counters the operator books."""
    return {"epoch": totals.epoch, "requests": sum(totals.requests.values()), "promptTokens": totals.prompt_tokens,
            "completionTokens": totals.completion_tokens, "cachedTokens": totals.cached_tokens}


def matches(acknowledged: Mapping[str, Any], totals: Totals) -> bool:
    expected = final_counters(totals)
    return all(isinstance(acknowledged.get(key), int | float) and not isinstance(acknowledged.get(key), bool)
               and float(acknowledged[key]) == value for key, value in expected.items())


class Drain:
    def __init__(self, server: Server, drain_seconds: float, final_read_seconds: float,
                 exit_now: Callable[[], None], connections: Connections | None = None,
                 delivery: Delivery | Collection | None = None) -> None:
        self.server = server
        self.delivery = delivery
        self.connections = connections
        self.drain_seconds = drain_seconds
        self.final_read_seconds = final_read_seconds
        self.exit_now = exit_now
        self.final_read = asyncio.Event()
        self.released = False
        self.task: asyncio.Task[None] | None = None
        self.began = 0.0
        # What a release must name (GET /internal/final-read gives it while draining): a signed release is good for
        # this process's drain alone, so one read off the plaintext metrics port cannot end another's wait
        self.nonce = ""

    def install(self) -> bool:
        """Take SIGTERM on the running loop (only possible from the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.begin)
        return True

    def begin(self) -> None:
        if self.task is not None:
            log.warning("Second SIGTERM: exiting without waiting for %d generation(s)", self.server.admission.used)
            self.exit_now()
            return
        self.began = time.monotonic()
        self.nonce = secrets.token_hex(16)
        self.server.draining = True
        self.server.metrics.draining.set(1)
        if self.server.budgets is not None:  # requests waiting for allowance go elsewhere (503, retried)
            self.server.budgets.close()
        if self.connections is not None:
            self.connections.close_after_responses()
        log.info("SIGTERM: draining (%d generation(s) running, %d queued, deadline %.0fs)",
                 self.server.admission.used, self.server.admission.queued, self.drain_seconds)
        self.task = asyncio.get_running_loop().create_task(self.run())

    def acknowledge(self, acknowledged: Mapping[str, Any]) -> bool:
        """The operator booked these counters. True (and the wait ends) only when draining is done and
        they are exactly this process's final ones."""
        done = self.server.draining and self.server.done
        if done and matches(acknowledged, self.server.metrics.totals):
            self.final_read.set()
            return True
        return False

    def release(self, released: Mapping[str, Any]) -> bool:
        """The operator will not book this pod (its CompletionService is gone): no final read to wait for. True
        (and the wait ends) only while draining, for this drain's nonce and these counters' epoch."""
        if not (self.nonce and released.get("nonce") == self.nonce
                and released.get("epoch") == self.server.metrics.totals.epoch):
            return False
        self.released = True
        self.final_read.set()
        return True

    async def run(self) -> None:
        server = self.server
        try:
            async with asyncio.timeout(self.drain_seconds):
                await server.wait_done()  # every request finished and recorded
        except TimeoutError:
            log.warning("Drain deadline reached with %d generation(s) still running and %d request(s) open: "
                        "aborting them", server.admission.used, len(server.runs))
            server.abort_all()
            try:
                async with asyncio.timeout(ABORT_GRACE_SECONDS):
                    await server.admission.wait_idle()  # the engine's final counts of what it aborted
            except TimeoutError:
                log.error("%d generation(s) did not end after their abort: they are billed as far as they "
                          "were read", server.admission.used)
            server.book_all()  # whatever their sockets do (a client that stopped reading holds nothing)
        await server.settle()
        if self.delivery is not None:  # the records reach the billing system before the pod goes
            left = max(FLUSH_SECONDS, self.began + self.drain_seconds - time.monotonic())
            if not await self.delivery.flush(left):  # the volume goes with the pod: what is left is lost
                log.error("Drained with %d usage record(s) not delivered to the billing system: counted lost",
                          self.delivery.abandon())
        unused = max(0.0, self.began + self.drain_seconds - time.monotonic())
        wait = self.final_read_seconds + unused if self.final_read_seconds > 0 else 0.0
        if wait > 0:
            try:
                async with asyncio.timeout(wait):
                    await self.final_read.wait()
                log.info("Drained; %s", "released by the operator" if self.released
                         else "the operator booked the final counters")
            except TimeoutError:
                log.warning("Drained, but no operator booked the final counters within %.0fs", wait)
        self.exit_now()

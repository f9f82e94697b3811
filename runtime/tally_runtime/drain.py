"""SIGTERM: stop admitting, let what is in flight finish, wait for a last read of /metrics, then exit.

The runtime owns the signal. SGLang installs its own SIGTERM handler on the serving loop the first time
it generates (SGLANG_CONTRACT.md §6) and would end the process while streams are still open, so this
handler is installed after the engine has started, replacing it. A second SIGTERM exits at once.

While draining, /health answers 503 (the pod leaves its Service), new requests get 503 with
Retry-After, and /metrics keeps answering, so that the operator can book the final counters
(`final_read_seconds`: how long an idle, draining runtime waits for that read).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable

from tally_runtime.serving import Server

log = logging.getLogger("tally_runtime.drain")


class Drain:
    def __init__(self, server: Server, drain_seconds: float, final_read_seconds: float,
                 exit_now: Callable[[], None]) -> None:
        self.server = server
        self.drain_seconds = drain_seconds
        self.final_read_seconds = final_read_seconds
        self.exit_now = exit_now
        self.final_read = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

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
        self.server.draining = True
        self.server.metrics.draining.set(1)
        log.info("SIGTERM: draining (%d generation(s) running, %d queued, deadline %.0fs)",
                 self.server.admission.used, self.server.admission.queued, self.drain_seconds)
        self.task = asyncio.get_running_loop().create_task(self.run())

    def metrics_read(self) -> None:
        """/metrics was served; once draining is done, that read holds the final counters."""
        if self.server.draining and self.server.admission.idle:
            self.final_read.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_seconds
        try:
            async with asyncio.timeout(self.drain_seconds):
                await self.server.admission.wait_idle()
        except TimeoutError:
            log.warning("Drain deadline reached with %d generation(s) still running", self.server.admission.used)
            self.exit_now()
            return
        if self.final_read_seconds > 0:
            wait = max(0.0, min(self.final_read_seconds, deadline - loop.time()))
            try:
                async with asyncio.timeout(wait):
                    await self.final_read.wait()
                log.info("Drained; the final counters were read")
            except TimeoutError:
                log.warning("Drained, but nobody read the final counters within %.0fs", wait)
        self.exit_now()

"""Admission: at most `limit` generations run at once; requests beyond that wait in one FIFO queue.

SGLang, vLLM and llama.cpp's server all queue rather than refuse, and no benchmark client honours
Retry-After, so a request that does not fit now waits its turn. The queue is bounded twice: in length
(`max_queued`) and in time (`max_wait`); only beyond those is a request refused (503 + Retry-After).
It is strictly first come, first served: a request needing several generations (n > 1, several prompts)
at the head is never overtaken by smaller ones behind it, so it cannot starve.
"""

from __future__ import annotations

import asyncio
from collections import deque


class QueueFull(Exception):
    """The request could not be admitted within the queue's bounds; `reason` says which one."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Admission:
    def __init__(self, limit: int, max_queued: int, max_wait: float) -> None:
        self.limit = limit
        self.max_queued = max_queued
        self.max_wait = max_wait
        self.used = 0
        self.waiting: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def queued(self) -> int:
        return len(self.waiting)

    @property
    def idle(self) -> bool:
        return self.used == 0 and not self.waiting

    async def wait_idle(self) -> None:
        """Until nothing runs and nobody waits."""
        await self._idle.wait()

    async def acquire(self, count: int) -> None:
        """Take `count` generation slots, waiting in line if needed. Raises `QueueFull`."""
        if not self.waiting and self.used + count <= self.limit:
            self.used += count
            self._idle.clear()
            return
        if len(self.waiting) >= self.max_queued:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        entry = (count, asyncio.get_running_loop().create_future())
        self.waiting.append(entry)
        self._idle.clear()
        try:
            async with asyncio.timeout(self.max_wait):
                await entry[1]
        except BaseException as err:
            if entry[1].done() and not entry[1].cancelled():  # granted just as we gave up: hand it back
                self.release(count)
            else:
                self.waiting.remove(entry)
                self._grant()  # the head may have left: whoever is next may fit now
            if isinstance(err, TimeoutError):
                raise QueueFull(f"no capacity within {self.max_wait:g}s") from None
            raise

    def release(self, count: int) -> None:
        self.used -= count
        self._grant()

    def _grant(self) -> None:
        self._admit_waiting()
        if self.idle:
            self._idle.set()

    def _admit_waiting(self) -> None:
        while self.waiting and self.used + self.waiting[0][0] <= self.limit:
            count, future = self.waiting.popleft()
            self.used += count
            future.set_result(None)

"""Admission: at most `limit` generations run at once; requests beyond that wait in one FIFO queue.

SGLang, vLLM and llama.cpp's server all queue rather than refuse, and no benchmark client honours
Retry-After, so a request that does not fit now waits its turn. The queue is bounded twice: in length
(`max_queued`) and in time (`max_wait`); only beyond those is a request refused (503 + Retry-After).
It is strictly first come, first served: a request needing several generations (n > 1, several prompts)
at the head is never overtaken by smaller ones behind it, so it cannot starve.

A waiter ends exactly one way: granted or given up. Its client can leave (its task is cancelled) or its
wait can time out in the same loop turn as a `release()` that would grant it; whichever resolves its
future first wins. A cancelled future is never granted (it leaves the queue the next time the queue is
walked), and a grant that lands just before the cancel is handed back, so no slot is lost or counted twice.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    """The request could not be admitted within the queue's bounds; `reason` says which one."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False, slots=True)
class _Waiter:
    count: int
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    in_line: bool = True  # counted in `queued`; cleared exactly once, when granted or given up


class Admission:
    def __init__(self, limit: int, max_queued: int, max_wait: float) -> None:
        self.limit = limit
        self.max_queued = max_queued
        self.max_wait = max_wait
        self.used = 0
        self.waiting: deque[_Waiter] = deque()
        self._queued = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def idle(self) -> bool:
        return self.used == 0 and not self.queued

    async def wait_idle(self) -> None:
        """Until nothing runs and nobody waits."""
        await self._idle.wait()

    async def acquire(self, count: int) -> None:
        """Take `count` generation slots, waiting in line if needed. Raises `QueueFull`."""
        if not self.queued and self.used + count <= self.limit:
            self.used += count
            self._idle.clear()
            return
        if self.queued >= self.max_queued:
            raise QueueFull(f"{self.queued} requests are already waiting")
        waiter = _Waiter(count)
        self.waiting.append(waiter)
        self._queued += 1
        self._idle.clear()
        try:
            async with asyncio.timeout(self.max_wait):
                await waiter.future
        except BaseException as err:
            self._give_up(waiter)
            if isinstance(err, TimeoutError):
                raise QueueFull(f"no capacity within {self.max_wait:g}s") from None
            raise

    def _give_up(self, waiter: _Waiter) -> None:
        """The waiter stopped waiting (cancelled or timed out): hand back a grant it got, or leave the line."""
        if waiter.future.done() and not waiter.future.cancelled():
            self.release(waiter.count)  # granted in the same turn as the cancel: the slots go back
            return
        waiter.future.cancel()
        if waiter.in_line:
            self.waiting.remove(waiter)
            self._leave(waiter)
        self._grant()  # the head may have left: whoever is next may fit now

    def release(self, count: int) -> None:
        if count > self.used:
            raise RuntimeError(f"releasing {count} generation slots while only {self.used} are in use")
        self.used -= count
        self._grant()

    def _grant(self) -> None:
        while self.waiting:
            head = self.waiting[0]
            if head.future.done():  # given up, not yet removed by its own task
                self._leave(self.waiting.popleft())
                continue
            if self.used + head.count > self.limit:
                break
            self._leave(self.waiting.popleft())
            self.used += head.count
            head.future.set_result(None)
        if self.idle:
            self._idle.set()

    def _leave(self, waiter: _Waiter) -> None:
        if waiter.in_line:
            waiter.in_line = False
            self._queued -= 1

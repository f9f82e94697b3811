"""Choice fan-in: the deltas of a request's choices, interleaved in arrival order, in batches.

Each choice is pumped by its own task into one mailbox (like vLLM's `merge_async_iterators`), so a
consumer that lags finds several deltas waiting and takes them at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from tally_runtime.engine.base import Delta, Engine, EngineError, GenerationRequest


class Mailbox:
    """Deltas from many producer tasks to one consumer, taken all at once: what piled up is one batch."""

    def __init__(self, producers: int) -> None:
        self.items: list[tuple[int, Delta]] = []
        self.open = producers
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: tuple[int, Delta]) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def close(self, error: Exception | None = None) -> None:
        """One producer is done, with the error that ended it, if any (the first error is kept)."""
        self.open -= 1
        if error is not None and self.error is None:
            self.error = error
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take_all(self) -> list[tuple[int, Delta]]:
        """Everything waiting; empty only once every producer is done or one has failed."""
        while not self.items and self.open and self.error is None:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


async def merge_choices(engine: Engine,
                        requests: Sequence[GenerationRequest]) -> AsyncIterator[list[tuple[int, Delta]]]:
    """Interleave the choices' deltas in arrival order, batching whatever is already waiting.

    Each choice is pumped by its own task into one mailbox, so a slow consumer finds several deltas
    ready and takes them at once. An engine error ends the stream after the deltas that came before
    it. Closing this aborts every choice still running.
    """
    mailbox = Mailbox(len(requests))

    async def pump(index: int, request: GenerationRequest) -> None:
        last: Delta | None = None
        try:
            async with aclosing(engine.generate(request)) as deltas:  # type: ignore[type-var]
                async for last in deltas:
                    mailbox.put((index, last))
        except Exception as err:
            mailbox.close(err)
            return
        if last is None or last.finish_reason is None:
            mailbox.close(EngineError("The engine ended a generation without a finish reason", 500))
        else:
            mailbox.close()

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        while batch := await mailbox.take_all():
            yield batch
            if mailbox.error is not None:
                break
        if mailbox.error is not None:
            raise mailbox.error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""Choice fan-in: the deltas of a request's choices, interleaved in arrival order, in batches.

Each choice is pumped by its own task into one mailbox (like vLLM's `merge_async_iterators`), so a
consumer that lags finds several deltas waiting and takes them at once.

Ending a request early (its client left, another choice failed, the drain ran out of time) asks the engine
to abort each unfinished choice and then waits, briefly, for the engine's last word on it: the final item
that carries what it generated (SGLang counts a token or two past the last item we read). Only a choice
that does not end within that bound is cancelled outright, billed as far as we read it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing

from tally_runtime.engine.base import Delta, Engine, EngineError, GenerationRequest, ItemStream

Batch = list[tuple[int, Delta]]

# How long an aborted choice may take to deliver its final counts before it is cancelled outright.
ABORT_SETTLE_SECONDS = 5.0


class Mailbox:
    """Deltas from many producer tasks to one consumer, taken all at once: what piled up is one batch."""

    def __init__(self, producers: int) -> None:
        self.items: Batch = []
        self.open = producers
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: tuple[int, Delta]) -> None:
        self.items.append(item)
        if self.waiter is not None:
            self._wake()

    def close(self, error: Exception | None = None) -> None:
        """One producer is done, with the error that ended it, if any (the first error is kept)."""
        self.open -= 1
        if error is not None and self.error is None:
            self.error = error
        if self.waiter is not None:
            self._wake()

    def _wake(self) -> None:
        """Wake the consumer once: the puts that follow before it runs need not look at it again."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take_all(self, stop_on_error: bool = True) -> Batch:
        """Everything waiting; empty only once every producer is done (or, by default, one has failed)."""
        while not self.items and self.open and (self.error is None or not stop_on_error):
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


class Choices:
    """The running choices of one request: their deltas as batches, and a way to end them early."""

    def __init__(self, engine: Engine, requests: Sequence[GenerationRequest]) -> None:
        self.engine = engine
        self.requests = list(requests)
        self.mailbox = Mailbox(len(self.requests))
        self.finished: set[int] = set()  # choices whose engine generator has ended
        self.finals: Batch = []  # last items that came with a failure (EngineError.final): counts, not output
        self.aborting = False
        self.on_engine_done: Callable[[], None] | None = None  # once every choice's engine generation ended
        self.tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(self.requests)]

    async def _pump(self, index: int, request: GenerationRequest) -> None:
        if self.aborting:  # aborted before it reached the engine: nothing to generate or bill
            self.finished.add(index)
            self.mailbox.close()
            return
        try:
            source = self.engine.generate(request)
            if isinstance(source, ItemStream):
                last = await self._pump_items(index, source)
            else:
                last = await self._pump_deltas(index, source)
        except Exception as err:
            self.finished.add(index)
            final = getattr(err, "final", None)
            if final is not None:
                self.finals.append((index, final))
            self._close(err)
            return
        self.finished.add(index)
        if last is None or last.finish_reason is None:
            self._close(EngineError("The engine ended a generation without a finish reason", 500))
        else:
            self._close(None)

    def _close(self, error: Exception | None) -> None:
        self.mailbox.close(error)
        if not self.mailbox.open and self.on_engine_done is not None:
            self.on_engine_done()

    # The two loops below run once per engine item, per token when the reader keeps up: kept lean.

    async def _pump_deltas(self, index: int, source: AsyncIterator[Delta]) -> Delta | None:
        last: Delta | None = None
        put = self.mailbox.put
        async with aclosing(source) as deltas:  # type: ignore[type-var]
            async for last in deltas:
                if last.finish_reason is not None:
                    self.finished.add(index)  # the engine is done with it: nothing left to abort
                put((index, last))
        return last

    async def _pump_items(self, index: int, source: ItemStream) -> Delta | None:
        """`ItemStream.deltas` inlined: the engine's items converted here, without a generator between."""
        last: Delta | None = None
        put, convert = self.mailbox.put, source.convert
        started = False
        try:
            async for item in await source.open():
                if not started:
                    started = True
                    source.first_item()
                last = convert(item)
                if last.finish_reason is not None:
                    self.finished.add(index)
                    put((index, last))
                    break
                put((index, last))
        except Exception as err:
            raise source.failed(err, started) from None
        finally:
            await source.close(last is not None and last.finish_reason is not None)
        return last

    async def batches(self) -> AsyncIterator[Batch]:
        """Interleave the choices' deltas in arrival order, batching whatever is already waiting. An engine
        error ends the stream after the deltas that came before it."""
        while batch := await self.mailbox.take_all():
            yield batch
            if self.mailbox.error is not None:
                break
        if self.mailbox.error is not None:
            raise self.mailbox.error

    async def abort(self, settle_seconds: float = ABORT_SETTLE_SECONDS) -> Batch:
        """Abort every unfinished choice and return what the engine still sent for them (their final
        counts among it), waiting at most `settle_seconds`; then cancel whatever is left."""
        self.abort_engine()
        late: Batch = []
        if self.mailbox.open:  # (every request that ran to its end skips the timer)
            try:
                async with asyncio.timeout(settle_seconds):
                    while batch := await self.mailbox.take_all(stop_on_error=False):
                        late.extend(batch)
            except TimeoutError:
                pass
        late.extend(self.mailbox.items)
        self.mailbox.items = []
        await self.cancel()
        return late

    def abort_engine(self) -> None:
        """Ask the engine to end every unfinished choice; one not started yet never starts."""
        self.aborting = True
        for index, request in enumerate(self.requests):
            if index not in self.finished:
                self.engine.abort(request.request_id)

    async def cancel(self) -> None:
        """End every pump now (closing a generation aborts it in the engine too)."""
        running = [task for task in self.tasks if not task.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)

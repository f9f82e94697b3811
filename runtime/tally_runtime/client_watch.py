"""The client's side of a response: notice when it leaves, and stream to it from the request's own task.

Once a request's body is read, a `ClientWatch` waits for `http.disconnect` and then cancels the task
serving the request, whatever it is doing: waiting in the admission queue, in prefill, collecting a
whole answer or streaming. The serving code sees an ordinary cancellation (its books close as for any
early end) and `respond` turns it into the 499 nobody reads.

A client that stays connected but stops reading is a leaver too: `StallGuard` ends a stream whose write
has not been taken for `--send-stall-seconds` by hanging up its connection (the hook the runtime's HTTP
protocol puts in the scope, http_limits.py), which the watch then sees as a disconnect. One check a second
covers every stream; the hot path pays two stores per write.

`EventStreamResponse` sends the SSE body in the task that handled the request. Starlette's
`StreamingResponse` starts a task group with two more tasks per stream to do the same; under load every
task hop waits a whole turn of the event loop, which at a thousand streams is most of the time to first
event (benchmarks/README.md, relay).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("tally_runtime.client")

HANG_UP = "tally.hang_up"  # the scope key of the connection's hang-up hook (http_limits.py)


class ClientGone(Exception):
    """The client left; the request's work was cancelled."""


class ClientWatch:
    """Cancels the current task when the client disconnects. Use as a context manager around the work; the
    work's `CancelledError` comes out as `ClientGone` when the client's leaving caused it."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.cancelled = False  # this watch cancelled the task, and that cancellation is still pending
        self.task: asyncio.Task[object] | None = None
        self.watcher: asyncio.Task[None] | None = None

    def start(self) -> ClientWatch:
        self.task = asyncio.current_task()
        self.watcher = asyncio.create_task(self._watch())
        return self

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        if self.task is not None:
            self.cancelled = True
            self.task.cancel()

    def left(self, error: BaseException) -> bool:
        """Whether `error` is this watch's cancellation; if so it is consumed (the task may carry on). A
        cancellation someone else asked for as well (the server stopping) goes on."""
        if not (self.cancelled and isinstance(error, asyncio.CancelledError) and self.task is not None):
            return False
        self.cancelled = False
        return self.task.uncancel() == 0

    async def __aenter__(self) -> ClientWatch:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if error is not None and self.left(error):
            raise ClientGone from None


class StallGuard:
    """Ends the streams whose client has not taken a write for `seconds` (it stopped reading)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.streams: set[EventStreamResponse] = set()
        self.task: asyncio.Task[None] | None = None
        self.on_end: Callable[[], object] | None = None  # counts each stream it ends (the app's metric)

    def watch(self, response: EventStreamResponse) -> None:
        self.streams.add(response)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._check())

    def forget(self, response: EventStreamResponse) -> None:
        self.streams.discard(response)

    async def _check(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.streams:
                await asyncio.sleep(min(1.0, self.seconds / 4))
                now = loop.time()
                for response in [r for r in self.streams if r.blocked_since and now - r.blocked_since > self.seconds]:
                    if self.on_end is not None:
                        self.on_end()
                    log.info("Ending a stream whose client took no data for %.0fs", self.seconds)
                    self.streams.discard(response)
                    response.hang_up()
        finally:
            self.task = None


class EventStreamResponse(Response):
    """An SSE body sent from the handling task, under the request's `ClientWatch` (stopped at the end)."""

    def __init__(self, body: AsyncIterator[bytes], watch: ClientWatch, media_type: str,
                 headers: Mapping[str, str], guard: StallGuard | None = None) -> None:
        # As StreamingResponse does: no `body` attribute, so no Content-Length (the body is chunked).
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(dict(headers))
        self.body_iterator = body
        self.watch = watch
        self.guard = guard
        self.blocked_since = 0.0  # loop time a write began that has not been taken yet (0: none)
        self._hang_up: Callable[[], None] | None = None

    def hang_up(self) -> None:
        """End the stream as if the client had left: close the connection (the watch sees it), or, on a
        server without the hook, cancel the task as the watch would."""
        if self._hang_up is not None:
            self._hang_up()
        elif self.watch.task is not None:
            self.watch.cancelled = True
            self.watch.task.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guard = self.guard
        if guard is not None:
            self._hang_up = scope.get(HANG_UP)
            guard.watch(self)
        clock = asyncio.get_running_loop().time
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                self.blocked_since = clock()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.blocked_since = 0.0
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError as cancelled:
            if not self.watch.left(cancelled):
                raise
        finally:
            if guard is not None:
                guard.forget(self)
            self.watch.stop()
            with contextlib.suppress(Exception):
                # Left while a chunk was being sent: the body's books close here.
                await self.body_iterator.aclose()  # type: ignore[attr-defined]

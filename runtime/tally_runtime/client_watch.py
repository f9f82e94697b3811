"""The client's side of a response: notice when it leaves, and stream to it from the request's own task.

Once a request's body is read, a `ClientWatch` waits for `http.disconnect` and then cancels the task
serving the request, whatever it is doing: waiting in the admission queue, in prefill, collecting a
whole answer or streaming. The serving code sees an ordinary cancellation (its books close as for any
early end) and `respond` turns it into the 499 nobody reads.

`EventStreamResponse` sends the SSE body in the task that handled the request. Starlette's
`StreamingResponse` starts a task group with two more tasks per stream to do the same; under load every
task hop waits a whole turn of the event loop, which at a thousand streams is most of the time to first
event (benchmarks/README.md, relay).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


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


class EventStreamResponse(Response):
    """An SSE body sent from the handling task, under the request's `ClientWatch` (stopped at the end)."""

    def __init__(self, body: AsyncIterator[bytes], watch: ClientWatch, media_type: str,
                 headers: Mapping[str, str]) -> None:
        # As StreamingResponse does: no `body` attribute, so no Content-Length (the body is chunked).
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(dict(headers))
        self.body_iterator = body
        self.watch = watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError as cancelled:
            if not self.watch.left(cancelled):
                raise
        finally:
            self.watch.stop()
            with contextlib.suppress(Exception):
                # Left while a chunk was being sent: the body's books close here.
                await self.body_iterator.aclose()  # type: ignore[attr-defined]

"""A client that leaves, at every point of a request, through the real app (ASGI driven by hand).

The client here is a pair of ASGI callables: `receive` hands over the body and then answers
`http.disconnect` once the test says the client left; `send` keeps what it was given and can stall like
a paused transport (a write waiting for a client that is gone). Whatever the moment, the request is
recorded exactly once, billed what the engine generated, and its slots go back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
from scripted_engine import Script, ScriptedEngine, tokens

from tally_runtime import client_watch
from tally_runtime.app import create_app
from tally_runtime.engine.base import Delta, GenerationRequest
from tally_runtime.serving import Server
from tally_runtime.settings import Settings


class Client:
    def __init__(self, body: dict[str, Any], stall_at_chunk: int | None = None, stays: bool = False) -> None:
        self.body = orjson.dumps(body)
        self.stays = stays  # stalls without leaving: a client that stopped reading
        self.body_read = False
        self.left = asyncio.Event()
        self.stall_at_chunk = stall_at_chunk  # leave, and stall the write, when this body chunk is sent
        self.messages: list[dict[str, Any]] = []
        self.chunks = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if not self.body_read:
            self.body_read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.chunks.set()
            if len(self.body_chunks) == self.stall_at_chunk:
                if not self.stays:
                    self.left.set()
                await asyncio.Event().wait()  # the transport is paused; its client will never read

    @property
    def status(self) -> int:
        return int(next(m["status"] for m in self.messages if m["type"] == "http.response.start"))

    @property
    def body_chunks(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body" and m.get("body")]


def scope(path: str = "/v1/completions") -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 8000), "state": {}}


@contextlib.asynccontextmanager
async def running(engine: ScriptedEngine, **settings: Any) -> AsyncIterator[tuple[Any, Server, asyncio.Task[None]]]:
    """The app with its lifespan run: the server and the engine as `tally-runtime serve` has them."""
    app = create_app(Settings(**{"served_model_name": "m", "max_concurrent_generations": 4, "usage_records": False,
                                 **settings}), engine)
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    lifespan = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                       inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    try:
        async with asyncio.timeout(10):  # a request that never ends fails its test instead of hanging it
            yield app, app.state.server, lifespan
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await lifespan


def counter(srv: Server, name: str, labels: dict[str, str] | None = None) -> float:
    return sum(s.value for f in srv.metrics.registry.collect() for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()))


def booked_once_as(srv: Server, outcome: str) -> None:
    assert counter(srv, "tally_requests_total") == 1
    assert counter(srv, "tally_requests_total", {"outcome": outcome}) == 1
    assert counter(srv, "tally_usage_mismatches_total") == 0
    assert srv.admission.idle and not srv.runs and not srv.closing


def serve(app: Any, client: Client) -> asyncio.Task[None]:
    """One request in a task of its own, as uvicorn serves each."""
    return asyncio.create_task(app(scope(), client.receive, client.send))


async def no_task_left_but(*keep: asyncio.Task[Any]) -> None:
    """The watcher of a finished request is gone (one per request would pile up over a pod's life)."""
    await until(lambda: not {t for t in asyncio.all_tasks() if not t.done()} - {asyncio.current_task(), *keep})


class Tripwire(ScriptedEngine):
    """Calls `trip` once the engine has yielded `after` deltas of a generation."""

    def __init__(self, script: Script, after: int, trip: Callable[[], None]) -> None:
        super().__init__(script)
        self.after, self.trip, self.generated = after, trip, 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        async for delta in super().generate(request):
            self.generated = delta.completion_tokens or self.generated
            yield delta
            if self.generated == self.after:
                self.trip()


STREAM = {"prompt": "a b c", "max_tokens": 50, "stream": True}


def test_a_client_that_leaves_while_a_chunk_is_being_sent_is_billed_what_the_engine_generated() -> None:
    async def scenario() -> None:
        engine = ScriptedEngine(Script({0: tokens(50)}, paced=True))
        async with running(engine) as (app, srv, lifespan):
            client = Client(STREAM, stall_at_chunk=3)
            await serve(app, client)  # returns: the stalled write was cancelled
            await srv.settle()
            await no_task_left_but(lifespan)
            booked_once_as(srv, "aborted")
            billed = counter(srv, "tally_completion_tokens_total")
            streamed = sum(chunk.count(b'"text"') for chunk in client.body_chunks)
            assert 3 <= streamed < billed < 50  # the engine's own count: one past what went out

    asyncio.run(scenario())


def test_a_client_that_leaves_in_prefill_gets_499_and_is_recorded_once_unbilled() -> None:
    async def scenario() -> None:
        async with running(ScriptedEngine(Script({}, stall={0}))) as (app, srv, _lifespan):
            client = Client(STREAM)
            served = serve(app, client)
            await until(lambda: bool(srv.runs))  # admitted, waiting for its first token
            client.left.set()
            await served
            await srv.settle()
            assert client.status == 499
            booked_once_as(srv, "aborted")
            assert counter(srv, "tally_completion_tokens_total") == 0

    asyncio.run(scenario())


def test_a_client_that_leaves_while_its_whole_answer_is_collected_is_billed_and_recorded_once() -> None:
    async def scenario() -> None:
        client = Client(STREAM | {"stream": False})
        engine = Tripwire(Script({0: tokens(50)}, paced=True), after=5, trip=client.left.set)
        async with running(engine) as (app, srv, _lifespan):
            await serve(app, client)
            await srv.settle()
            assert client.status == 499
            booked_once_as(srv, "aborted")
            assert 5 <= counter(srv, "tally_completion_tokens_total") < 50

    asyncio.run(scenario())


def test_a_cancellation_that_is_not_the_clients_still_ends_the_task_and_closes_the_books() -> None:
    async def scenario() -> None:
        async with running(ScriptedEngine(Script({0: tokens(50)}, paced=True))) as (app, srv, _lifespan):
            client = Client(STREAM)
            served = serve(app, client)
            await client.chunks.wait()
            served.cancel()  # the server shutting down, say
            with pytest.raises(asyncio.CancelledError):
                await served
            await srv.settle()
            booked_once_as(srv, "aborted")

    asyncio.run(scenario())


def test_a_response_that_never_starts_still_closes_the_books(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request's task can end between the handler's return and the response's first byte (a cancel
    delivered in between, a framework error): the run is closed all the same, by the task's end."""

    async def never_starts(self: object, scope: object, receive: object, send: object) -> None:
        raise RuntimeError("the response never started")

    monkeypatch.setattr(client_watch.EventStreamResponse, "__call__", never_starts)

    async def scenario() -> None:
        async with running(ScriptedEngine(Script({0: tokens(50)}, paced=True))) as (app, srv, _lifespan):
            client = Client(STREAM)
            with pytest.raises(RuntimeError, match="never started"):
                await serve(app, client)
            await until(lambda: not srv.runs)
            await srv.settle()
            booked_once_as(srv, "aborted")

    asyncio.run(scenario())


def test_a_client_that_stays_gets_every_token_and_leaves_no_watcher_behind() -> None:
    async def scenario() -> None:
        async with running(ScriptedEngine(Script({0: tokens(50)}, paced=True))) as (app, srv, lifespan):
            for body in (STREAM, STREAM | {"stream": False}):
                client = Client(body)
                await serve(app, client)
                assert client.status == 200
            await srv.settle()
            await no_task_left_but(lifespan)
            assert counter(srv, "tally_requests_total", {"outcome": "ok"}) == 2
            assert counter(srv, "tally_completion_tokens_total") == 100
            assert srv.admission.idle

    asyncio.run(scenario())


def test_a_client_that_stops_reading_frees_its_slots_when_the_engine_is_done_and_is_recorded() -> None:
    """The review's case: with one slot, a stream whose client stopped reading held the slot after the engine
    went idle, and the next request got 503. Now the slot follows the engine; the stall limit ends the
    stream and books it (billed all the engine generated)."""
    async def scenario() -> None:
        engine = ScriptedEngine(Script({0: tokens(50)}, paced=True))
        async with running(engine, max_concurrent_generations=1, send_stall_seconds=0.5) as (app, srv, lifespan):
            stalled = Client(STREAM, stall_at_chunk=1, stays=True)
            served = serve(app, stalled)
            await until(lambda: srv.admission.idle and bool(srv.runs))  # engine done, client not
            assert counter(srv, "tally_requests_total") == 0  # not recorded yet: still being sent
            next_one = Client(STREAM | {"stream": False})
            await serve(app, next_one)
            assert next_one.status == 200  # the slot was free
            await served  # the stall limit ended it
            await srv.settle()
            assert counter(srv, "tally_requests_total", {"outcome": "aborted"}) == 1
            assert counter(srv, "tally_completion_tokens_total") == 50 + 50  # the scripted engine's 50 each
            assert srv.done
            await no_task_left_but(lifespan)

    asyncio.run(scenario())


def test_a_stalled_reader_at_the_drain_deadline_is_recorded_and_the_final_read_happens() -> None:
    from tally_runtime.drain import Drain, final_counters

    async def scenario() -> None:
        engine = ScriptedEngine(Script({0: tokens(50)}, paced=True))
        async with running(engine, send_stall_seconds=600) as (app, srv, _lifespan):
            stalled = Client(STREAM, stall_at_chunk=1, stays=True)
            served = serve(app, stalled)
            await until(lambda: srv.admission.idle and bool(srv.runs))
            exited = asyncio.Event()
            drain = Drain(srv, drain_seconds=0.2, final_read_seconds=10, exit_now=exited.set)
            drain.begin()
            await until(lambda: srv.done)  # booked at the deadline, its socket still stalled
            assert counter(srv, "tally_completion_tokens_total") == 50
            assert not exited.is_set()  # waiting for the operator's final read
            assert drain.acknowledge({**final_counters(srv.metrics.totals)})
            await exited.wait()
            served.cancel()  # what uvicorn's graceful shutdown does to a connection that never ends
            with contextlib.suppress(asyncio.CancelledError):
                await served
            assert counter(srv, "tally_requests_total") == 1

    asyncio.run(scenario())


def test_a_client_that_leaves_while_its_refusal_closes_is_still_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancellation used to replace the refusal while the close was awaited: nothing was recorded."""
    from tally_runtime.engine.base import InvalidRequestError
    from tally_runtime.serving import Run

    client = Client(STREAM)
    close = Run.close

    async def close_as_the_client_leaves(self: Run, refused: bool = False) -> None:
        closing = asyncio.ensure_future(close(self, refused))
        if refused:
            client.left.set()  # the watch cancels the request's task while it awaits this close
        await asyncio.shield(closing)

    monkeypatch.setattr(Run, "close", close_as_the_client_leaves)

    async def scenario() -> None:
        engine = ScriptedEngine(Script({}, error={0: InvalidRequestError("refused by the engine", param="prompt")}))
        async with running(engine) as (app, srv, _lifespan):
            await serve(app, client)
            await srv.settle()
            assert client.status == 499
            booked_once_as(srv, "invalid")

    asyncio.run(scenario())


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    """Poll with a deadline: the task set and the server's tables have no event of their own to wait on."""
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.001)

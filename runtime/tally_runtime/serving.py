"""Serving a prepared `Job` on the engine: admission, priming, the two response forms, accounting.

`Server.start` admits a job (waiting in the FIFO queue if needed) and primes its first delta, so that
engine refusals still become HTTP errors before the first byte; a refused request is recorded once and
bills nothing. A `Run` then either streams SSE bytes or builds one JSON response, and records its usage
and outcome exactly once when it closes. Per-request state lives in the `Run` only, so one request's
output or error cannot reach another's stream.

Who records what, so that every request is recorded exactly once: the HTTP layer (respond.py) records
requests refused before they were admitted; `Server.start` records a client that left while queued;
a `Run`, once admitted, records itself when it closes, however it ends (finished, failed, its client
gone in prefill or mid-stream). A run that ends early aborts its unfinished choices and bills what the
engine reports it generated for them; that last part runs in a task of its own, so a cancelled request
task cannot cut the books short.

A run's generation slots follow the engine, not the socket: they go back as soon as every choice's engine
generation has ended, also while its client is still reading (or has stopped reading: what the engine
made waits in the run's mailbox, at most n x max_tokens deltas, until the send-stall limit ends the
stream, client_watch.StallGuard). The run is recorded when it closes, and `Server.quiet` tells the drain
when every run is recorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from tally_runtime import contract
from tally_runtime.admission import Admission, QueueFull
from tally_runtime.auth import Tenant
from tally_runtime.budgets import QUOTA_CODE, Budgets, Reservation, reservation_tokens
from tally_runtime.engine.base import Delta, Engine, EngineError, EngineInfo, FinishReason, InvalidRequestError
from tally_runtime.fanin import Batch, Choices
from tally_runtime.ledger import Journal
from tally_runtime.metrics import Metrics
from tally_runtime.prepare import Job, Preparer
from tally_runtime.protocol import ApiError
from tally_runtime.records import RecordSink, UsageRecord
from tally_runtime.render import EventRenderer
from tally_runtime.streaming import ChoiceResult
from tally_runtime.usage import ChoiceUsage, RequestUsage, request_usage

log = logging.getLogger("tally_runtime.serving")

RETRY_AFTER = {"Retry-After": "1"}


def api_error(err: EngineError) -> ApiError:
    """An engine's refusal or failure as the HTTP error a client sees before the first byte."""
    if isinstance(err, InvalidRequestError):
        return ApiError(400, err.message, param=err.param)
    status = err.status_code if 400 <= err.status_code < 600 else 500
    return ApiError(status, err.message, headers=RETRY_AFTER if status == 503 else None)


class Server:
    """Everything a request needs, owned by the app's lifespan."""

    def __init__(self, engine: Engine, info: EngineInfo, model: str, metrics: Metrics, limit: int,
                 force_include_usage: bool = False, max_queued: int = 256, max_queue_seconds: float = 60.0,
                 journal: Journal | None = None, records: RecordSink | None = None) -> None:
        self.engine = engine
        self.journal = journal
        self.records = records
        self.info = info
        self.model = model
        self.metrics = metrics
        self.prepare = Preparer(engine, info, model, limit, force_include_usage)
        self.admission = Admission(limit, max_queued, max_queue_seconds)
        metrics.slots.set(limit)
        self.draining = False
        self.stopping = False  # past the drain's deadline: queued requests are refused when their turn comes
        self.runs: set[Run] = set()  # admitted and not yet closed
        self.closing: set[asyncio.Task[None]] = set()  # runs finishing their books (see Run.close)
        self.quiet = asyncio.Event()  # no run open: every admitted request is recorded
        self.quiet.set()
        self.budgets: Budgets | None = None  # per-tenant leases, when the operator manages budgets
        self.service = ("", "")  # (namespace, name) of the CompletionService, for the usage records

    async def reserve(self, job: Job, tenant: Tenant) -> Reservation | None:
        """The request's worst case, reserved from its tenant's lease: waiting, as for a generation slot and as
        long, while the pod asks for allowance the tenant's budget has (429 when it has none, or none came)."""
        if self.budgets is None:
            return None
        tokens = reservation_tokens([len(p) for p in job.prompts], job.n, job.sampling.max_tokens,
                                    self.budgets.weights)
        if not self.metrics.claim_label(tenant.name):  # it would be counted under `other`: untracked
            self.budgets.refuse_untracked(tenant.name, f"this replica counts at most {self.metrics.max_tenants} "
                                                       "tenants")
        self.metrics.queued.inc()
        try:
            return await self.budgets.acquire(tenant.name, tokens, self.admission.max_wait)
        except BaseException:
            self.metrics.release_label(tenant.name)
            raise
        finally:
            self.metrics.queued.dec()

    def return_reservation(self, reservation: Reservation | None, usage: RequestUsage | None) -> None:
        """After the request's usage was counted: its reservation returned, what it spent is in the counter."""
        if reservation is None or self.budgets is None:
            return
        billed = 0.0
        if usage is not None:
            billed = self.budgets.weights.of(usage.prompt_tokens, usage.cached_tokens or 0, usage.completion_tokens)
        if not reservation.settled:
            self.metrics.release_label(reservation.tenant)
        self.budgets.settle(reservation, billed)

    def reject(self, endpoint: str, error: ApiError, tenant: Tenant, job: Job | None = None) -> None:
        """Record a request refused before it started: once, with no usage."""
        if error.status == 503:
            outcome = contract.OUTCOME_OVERLOADED
        elif error.status == 429:
            outcome = contract.OUTCOME_OVER_BUDGET if error.code == QUOTA_CODE else contract.OUTCOME_RATE_LIMITED
        else:
            outcome = contract.OUTCOME_INVALID
        self.abandon(endpoint, outcome, tenant, job)

    def abandon(self, endpoint: str, outcome: str, tenant: Tenant, job: Job | None = None,
                started: float = 0.0) -> None:
        """Record a request that ended before it ran (refused, or its client left while it waited)."""
        now = time.time()
        record = UsageRecord(
            id=job.header.id if job else f"req-{uuid.uuid4().hex}", time=now, model=self.model, endpoint=endpoint,
            tenant=tenant.name, tenant_source=tenant.source, outcome=outcome,
            finish_reasons=(None,) * (job.generations if job else 0),
            n=job.generations if job else 0, stream=bool(job and job.stream), prompt_tokens=0, completion_tokens=0,
            cached_tokens=0, reasoning_tokens=0, derived=False, time_to_first_token_seconds=None,
            duration_seconds=max(0.0, time.monotonic() - started) if started else 0.0,
            namespace=self.service[0], service=self.service[1])
        self.record(record, "none")

    def fail(self, endpoint: str, tenant: Tenant, started: float) -> None:
        """Record a request that failed unexpectedly before it was admitted: an error, no usage."""
        self.abandon(endpoint, contract.OUTCOME_ERROR, tenant, None, started)

    def record(self, record: UsageRecord, finish_reason: str, usage: RequestUsage | None = None) -> None:
        """Count one finished request: the metrics, the journal and the usage record, from the same numbers."""
        self.metrics.record_request(record.endpoint, record.outcome, finish_reason, record.tenant_source)
        if usage is not None:
            self.metrics.record_usage(usage)
        if record.outcome not in contract.REFUSED_OUTCOMES:  # per tenant as in the totals: what was served
            self.metrics.record_tenant(record.tenant, usage)
        if self.journal is not None:
            self.journal.write(self.metrics.totals)
        if self.records is not None:
            self.records.write(record)

    async def start(self, job: Job, tenant: Tenant, started: float = 0.0) -> Run:
        """Admit the job and prime its first delta, so engine refusals still become HTTP errors.

        An `ApiError` (refused: not admitted, or the engine refused it before its first token) is left to
        the caller to record; a client that leaves while queued is recorded here, one that leaves in
        prefill by its run."""
        reservation = await self.reserve(job, tenant)
        try:
            await self._admit(job)
        except asyncio.CancelledError:
            self.return_reservation(reservation, None)
            self.abandon(job.endpoint.name, contract.OUTCOME_ABORTED, tenant, job, started)
            raise
        except BaseException:
            self.return_reservation(reservation, None)
            raise
        run = Run(self, job, tenant, reservation)
        try:
            await run.prime()
        except ApiError as error:
            # Recorded before the close is awaited: a client that leaves meanwhile cancels that await, and
            # its cancellation replaces this refusal
            self.reject(job.endpoint.name, error, tenant, job)
            error.recorded = True
            await run.close(refused=True)
            raise
        except BaseException:
            await run.close()
            raise
        return run

    async def settle(self) -> None:
        """Until every closed run has finished its books (before the engine stops)."""
        while self.closing:
            await asyncio.gather(*self.closing, return_exceptions=True)

    def abort_all(self) -> None:
        """The drain's deadline: ask the engine to end every running generation (each run then ends with an
        error event and is billed what the engine generated), and admit nobody still queued."""
        self.stopping = True
        for run in list(self.runs):
            run.abort()

    def book_all(self) -> None:
        """Close every run's books now, whatever its client's socket is doing (the drain is out of time)."""
        for run in list(self.runs):
            run.close_soon()

    @property
    def done(self) -> bool:
        """Nothing admitted, queued or unrecorded: the counters are final."""
        return self.admission.idle and not self.runs and not self.closing

    async def wait_done(self) -> None:
        await self.admission.wait_idle()
        await self.quiet.wait()
        await self.settle()

    async def _admit(self, job: Job) -> None:
        if self.draining:
            raise ApiError(503, "The server is shutting down; retry on another replica", code="shutting_down",
                           headers=RETRY_AFTER)
        queued_at = time.monotonic()
        self.metrics.queued.inc()
        try:
            await self.admission.acquire(job.generations)
        except QueueFull as full:
            raise ApiError(503, f"The server is at its limit of concurrent generations ({full.reason}); "
                                "retry shortly", code="overloaded", headers=RETRY_AFTER) from None
        finally:
            self.metrics.queued.dec()
        if self.stopping:
            self.admission.release(job.generations)
            raise ApiError(503, "The server is shutting down; retry on another replica", code="shutting_down",
                           headers=RETRY_AFTER)
        self.metrics.queue_time.observe(time.monotonic() - queued_at)
        self.metrics.inflight.inc(job.generations)

    def release(self, job: Job) -> None:
        self.admission.release(job.generations)
        self.metrics.inflight.dec(job.generations)


class Run:
    """One admitted job in flight: merges its choices' deltas and keeps its own accounts."""

    def __init__(self, server: Server, job: Job, tenant: Tenant, reservation: Reservation | None = None) -> None:
        self.server = server
        self.job = job
        self.tenant = tenant
        self.reservation = reservation
        self.usage = [ChoiceUsage(i, i // job.n, len(job.prompts[i // job.n])) for i in range(job.generations)]
        self.started = time.monotonic()
        self.first_token_seen = False
        self.time_to_first_token: float | None = None
        self.last_token_at: dict[int, float] = {}  # per choice: inter-token latency is per choice
        self.first: Batch | None = None
        self.choices = Choices(server.engine, job.requests())
        self.events: AsyncIterator[Batch] = self.choices.batches()
        self.outcome = contract.OUTCOME_ABORTED
        self.finish_reason = "none"
        self.closed = False
        self.released = False  # its slots went back (the engine is done with it)
        self.choices.on_engine_done = self.release
        server.runs.add(self)
        server.quiet.clear()

    async def prime(self) -> None:
        try:
            self.first = await anext(self.events)
        except EngineError as err:
            raise api_error(err) from None
        except StopAsyncIteration:
            raise ApiError(500, "The engine produced no output") from None
        except Exception:
            log.exception("Generation %s failed before its first token", self.job.header.id)
            raise ApiError(500, "Internal error while starting the generation") from None

    async def batches(self) -> AsyncIterator[Batch]:
        """Deltas in arrival order, in batches of whatever piled up while we were sending."""
        if self.first is not None:
            first, self.first = self.first, None
            yield first
        async for batch in self.events:
            yield batch

    def account(self, batch: Batch, each: Callable[[int, Delta], None]) -> EngineError | None:
        """Usage, finish reason and token latency for one batch; `each` sees every delta right after it
        was counted. Returns an engine's abort as an error, once the whole batch is counted: the other
        choices' deltas in it are passed on, only the aborted choice's last delta is not."""
        tokens: dict[int, int] = {}
        failure = None
        usage = self.usage
        for index, delta in batch:  # once per token when the client keeps up: kept lean
            usage[index].observe(delta)
            finish = delta.finish_reason
            if finish is not None:
                if finish is FinishReason.ABORT:
                    failure = failure or EngineError("The engine aborted the generation", 500)
                    continue
                self.finish_reason = str(finish)
            if delta.token_ids:
                tokens[index] = tokens.get(index, 0) + len(delta.token_ids)
            each(index, delta)
        self._timed(tokens)
        return failure

    def _timed(self, tokens: dict[int, int]) -> None:
        """Latency once per batch: the time since a choice's previous batch, spread over the tokens it
        brought. A choice's first batch has no inter-token gap (its wait is prefill: time to first token)."""
        if not tokens:
            return
        now = time.monotonic()
        metrics = self.server.metrics
        if not self.first_token_seen:
            self.first_token_seen = True
            self.time_to_first_token = now - self.started
            metrics.ttft.observe(self.time_to_first_token)
        for index, count in tokens.items():
            previous = self.last_token_at.get(index)
            if previous is not None:
                metrics.observe_tokens(now - previous, count)
            self.last_token_at[index] = now

    def release(self) -> None:
        """Give the run's slots back, once: the engine is done with it (or the run closed)."""
        if not self.released:
            self.released = True
            self.server.release(self.job)

    def abort(self) -> None:
        """Ask the engine to end this run's generations; each then ends with an ABORT delta."""
        self.choices.abort_engine()

    async def close(self, refused: bool = False) -> None:
        """End the run once: abort whatever still runs, record the request, release its slots.

        Choices still running are aborted and briefly awaited for the engine's final counts, which are
        billed. That work runs in a task of its own: when the client leaves, the task serving it is being
        cancelled, and the books must be finished all the same. A refused request (the engine refused it
        while priming) is recorded by the caller as rejected, unbilled."""
        if not self.closed:
            await asyncio.shield(self._close_in_background(refused))

    def close_soon(self, _: object = None) -> None:
        """Close the run unless it is closed, without waiting: a done callback of the task that served it,
        so a response that never started (its client gone before the first byte) still closes the books."""
        if not self.closed:
            self._close_in_background(False)

    def _close_in_background(self, refused: bool) -> asyncio.Future[None]:
        self.closed = True
        finishing = asyncio.ensure_future(self._finish(refused))
        self.server.closing.add(finishing)
        finishing.add_done_callback(self.server.closing.discard)
        return finishing

    async def _finish(self, refused: bool) -> None:
        server = self.server
        try:
            await self.events.aclose()  # type: ignore[attr-defined]
            if self.first is not None:  # primed, never sent (the response never started): still read
                for index, delta in self.first:
                    self.usage[index].observe(delta)
                self.first = None
            if refused:
                await self.choices.cancel()
            else:
                for index, delta in [*await self.choices.abort(), *self.choices.finals]:
                    self.usage[index].observe(delta)
        except Exception:
            log.exception("Ending generation %s failed; it is billed as far as it was read", self.job.header.id)
            await self.choices.cancel()
        finally:
            usage = None
            try:
                if not refused:
                    duration = time.monotonic() - self.started
                    usage = request_usage(self.usage)
                    server.record(self.usage_record(usage, duration), self.finish_reason, usage)
                    server.metrics.e2e.observe(duration)
            finally:
                server.return_reservation(self.reservation, usage)
                self.release()
                server.runs.discard(self)
                if not server.runs:
                    server.quiet.set()

    def usage_record(self, usage: RequestUsage, duration: float) -> UsageRecord:
        job = self.job
        return UsageRecord(
            id=job.header.id, time=time.time(), model=job.header.model, endpoint=job.endpoint.name,
            tenant=self.tenant.name, tenant_source=self.tenant.source,
            outcome=self.outcome, finish_reasons=tuple(c.finish_reason for c in self.usage), n=job.generations,
            stream=job.stream, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens or 0, reasoning_tokens=usage.reasoning_tokens or 0,
            derived=usage.derived, time_to_first_token_seconds=self.time_to_first_token, duration_seconds=duration,
            namespace=self.server.service[0], service=self.server.service[1])

    # ---- the two response forms

    async def stream(self) -> AsyncIterator[bytes]:
        job = self.job
        render = (job.endpoint.renderer or EventRenderer)(job, self.usage)
        try:
            # One write per batch: when the client lags, the deltas that piled up go out together,
            # each still its own `data:` event, in order.
            async for batch in self.batches():
                failure = self.account(batch, render.add)
                events = render.take()
                if events:
                    yield events
                if failure is not None:
                    raise failure
            self.outcome = contract.OUTCOME_OK
            yield render.finish(request_usage(self.usage).as_openai())
        except EngineError as err:
            self.outcome = contract.OUTCOME_ERROR
            log.warning("Generation %s failed mid-stream: %s", job.header.id, err.message)
            yield render.fail(err.message, code=err.status_code)
        except Exception:
            self.outcome = contract.OUTCOME_ERROR
            log.exception("Generation %s failed mid-stream", job.header.id)
            yield render.fail("Internal error while generating")
        finally:
            await self.close()

    async def collect(self) -> dict[str, Any]:
        job = self.job
        results = [ChoiceResult(i) for i in range(job.generations)]
        texts: list[list[str]] = [[] for _ in results]

        def keep(index: int, delta: Delta) -> None:
            texts[index].append(delta.text)
            if delta.logprobs is not None:
                results[index].logprobs = [*(results[index].logprobs or []), *delta.logprobs]
            if delta.finish_reason is not None:
                results[index].finish_reason = str(delta.finish_reason)

        try:
            async for batch in self.batches():
                failure = self.account(batch, keep)
                if failure is not None:
                    raise failure
            self.outcome = contract.OUTCOME_OK
        except EngineError as err:
            self.outcome = contract.OUTCOME_ERROR
            raise api_error(err) from None
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            self.outcome = contract.OUTCOME_ERROR
            log.exception("Generation %s failed", job.header.id)
            raise ApiError(500, "Internal error while generating") from None
        finally:
            await self.close()
        for result, parts in zip(results, texts, strict=True):
            prefix = job.prompt_texts[result.index // job.n] if job.echo else ""
            result.text, result.text_offset = prefix + "".join(parts), len(prefix)
        return job.endpoint.response(job.header, results, request_usage(self.usage).as_openai(), job.tools)

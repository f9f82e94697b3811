"""Serving a validated OpenAI request on the engine: admission, prompts, choices, usage, metrics.

The HTTP layer (routes/) parses and hands over; this module prepares a `Job` (everything that can
fail with a 4xx happens here, before the first byte), then either streams SSE bytes or builds one
JSON response. Per-request state lives in local variables only, so one request's output or error
cannot reach another's stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from tally_runtime import metric_names as names
from tally_runtime import sse
from tally_runtime.engine.base import (
    Delta,
    Engine,
    EngineError,
    EngineInfo,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from tally_runtime.metrics import Metrics
from tally_runtime.protocol import ApiError, ChatCompletionRequest, CompletionRequest, SamplingRequest
from tally_runtime.streaming import (
    ChatChunks,
    ChoiceResult,
    CompletionChunks,
    ResponseHeader,
    chat_response,
    completion_response,
)
from tally_runtime.usage import ChoiceUsage, request_usage

log = logging.getLogger("tally_runtime.serving")

COMPLETIONS = "completions"
CHAT = "chat"


@dataclass(frozen=True, slots=True)
class Job:
    """A request that passed validation and admission: ready to generate."""

    endpoint: str
    header: ResponseHeader
    prompts: tuple[tuple[int, ...], ...]
    prompt_texts: tuple[str, ...]
    n: int
    sampling: SamplingParams
    echo: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool

    @property
    def generations(self) -> int:
        return len(self.prompts) * self.n

    def requests(self) -> list[GenerationRequest]:
        """Choice index = prompt index * n + sample; ids end with '.', so none is a prefix of another."""
        return [
            GenerationRequest(f"{self.header.id}.{p * self.n + s}.", prompt, self.sampling)
            for p, prompt in enumerate(self.prompts)
            for s in range(self.n)
        ]


class Admission:
    """At most `limit` generations at once; beyond that a request is refused, not queued."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def try_acquire(self, count: int) -> bool:
        if self.used + count > self.limit:
            return False
        self.used += count
        return True

    def release(self, count: int) -> None:
        self.used -= count


class Server:
    """Everything a request needs, owned by the app's lifespan."""

    def __init__(self, engine: Engine, info: EngineInfo, model: str, metrics: Metrics, limit: int,
                 force_include_usage: bool = False) -> None:
        self.engine = engine
        self.info = info
        self.model = model
        self.metrics = metrics
        self.admission = Admission(limit)
        self.force_include_usage = force_include_usage

    # ---- preparation: every 4xx is raised here, before any byte is sent

    def prepare_completion(self, req: CompletionRequest) -> Job:
        self._check_common(req)
        if req.best_of is not None and req.best_of > 1 and req.stream:
            raise ApiError(400, "best_of > 1 cannot be streamed", param="best_of")
        if req.best_of is not None and req.best_of < req.n:
            raise ApiError(400, f"best_of ({req.best_of}) must be at least n ({req.n})", param="best_of")
        prompts, texts = self._completion_prompts(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        for ids in prompts:
            self._check_context(len(ids), max_tokens, "prompt")
        return self._job(COMPLETIONS, "cmpl", req, prompts, texts, max_tokens, req.logprobs, req.echo)

    def prepare_chat(self, req: ChatCompletionRequest) -> Job:
        self._check_common(req)
        text = self.engine.render_chat([{"role": m.role, "content": m.text()} for m in req.messages])
        ids = tuple(self.engine.tokenize(text))
        limit = req.token_limit()
        max_tokens = limit if limit is not None else self.info.context_length - len(ids)
        self._check_context(len(ids), max_tokens, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return self._job(CHAT, "chatcmpl", req, ((ids),), (text,), max_tokens, logprobs, False)

    def _check_common(self, req: SamplingRequest) -> None:
        if req.model is not None and req.model != self.model:
            raise ApiError(404, f"The model {req.model!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options can only be set when stream is true", param="stream_options")
        if req.unknown_fields():
            log.info("Ignoring unsupported request fields %s", ", ".join(req.unknown_fields()))

    def _completion_prompts(self, prompt: Any) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "Prompt cannot be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        ids: list[tuple[int, ...]] = []
        texts: list[str] = []
        for item in prompt:
            if isinstance(item, str):
                if not item:
                    raise ApiError(400, "Prompt cannot be empty", param="prompt")
                ids.append(tuple(self.engine.tokenize(item)))
                texts.append(item)
            else:
                if not item:
                    raise ApiError(400, "Prompt cannot be empty", param="prompt")
                bad = [t for t in item if not 0 <= t < self.info.vocab_size]
                if bad:
                    raise ApiError(400, f"Token id {bad[0]} is out of range [0, {self.info.vocab_size})",
                                   param="prompt")
                ids.append(tuple(item))
                texts.append(self.engine.detokenize(item))
        return tuple(ids), tuple(texts)

    def _check_context(self, prompt_len: int, max_tokens: int, param: str) -> None:
        limit = self.info.context_length
        if prompt_len + max_tokens > limit or max_tokens < 0:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in the prompt, "
                f"{max(max_tokens, 0)} for the completion). Please reduce the prompt or max_tokens.",
                param=param, code="context_length_exceeded",
            )

    def _job(self, endpoint: str, prefix: str, req: SamplingRequest, prompts: tuple[tuple[int, ...], ...],
             texts: tuple[str, ...], max_tokens: int, logprobs: int | None, echo: bool) -> Job:
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            seed=req.seed, stop=req.stop_list(), presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            ignore_eos=req.ignore_eos, min_tokens=min(req.min_tokens, max_tokens), logprobs=logprobs,
        )
        options = req.stream_options
        header = ResponseHeader(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.model)
        return Job(
            endpoint=endpoint, header=header, prompts=prompts, prompt_texts=texts, n=req.n, sampling=sampling,
            echo=echo, stream=req.stream,
            include_usage=bool(options and options.include_usage) or self.force_include_usage,
            continuous_usage=bool(options and options.continuous_usage_stats),
        )

    def admit(self, job: Job) -> None:
        if job.generations > self.admission.limit:
            raise ApiError(400, f"This request needs {job.generations} concurrent generations (prompts x n); "
                                f"the server runs at most {self.admission.limit}", param="n")
        if not self.admission.try_acquire(job.generations):
            raise ApiError(503, "The server is at its limit of concurrent generations; retry shortly",
                           code="overloaded", headers={"Retry-After": "1"})
        self.metrics.inflight.inc(job.generations)

    def release(self, job: Job) -> None:
        self.admission.release(job.generations)
        self.metrics.inflight.dec(job.generations)

    def reject(self, endpoint: str, error: ApiError) -> None:
        outcome = names.OUTCOME_OVERLOADED if error.status == 503 else names.OUTCOME_INVALID
        self.metrics.record_request(endpoint, outcome, "none")

    # ---- running

    async def start(self, job: Job) -> Run:
        """Admit the job and prime its first delta, so engine refusals still become HTTP errors."""
        self.admit(job)
        run = Run(self, job)
        try:
            await run.prime()
        except BaseException:
            await run.close()
            raise
        return run


class Run:
    """One admitted job in flight: merges its choices' deltas and keeps its own accounts."""

    def __init__(self, server: Server, job: Job) -> None:
        self.server = server
        self.job = job
        self.usage = [ChoiceUsage(i, i // job.n, len(job.prompts[i // job.n])) for i in range(job.generations)]
        self.started = time.monotonic()
        self.first_token_seen = False
        self.last_token_at: dict[int, float] = {}  # per choice: inter-token latency is per choice
        self.first: list[tuple[int, Delta]] | None = None
        self.events: AsyncIterator[list[tuple[int, Delta]]] = merge_choices(server.engine, job.requests())
        self.outcome = names.OUTCOME_ABORTED
        self.finish_reason = "none"
        self.closed = False

    async def prime(self) -> None:
        try:
            self.first = await anext(self.events)
        except InvalidRequestError as err:
            raise ApiError(400, err.message, param=err.param) from None
        except EngineError as err:
            status = err.status_code if 400 <= err.status_code < 600 else 500
            raise ApiError(status, err.message) from None

    async def batches(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        """Deltas in arrival order, in batches of whatever piled up while we were sending."""
        if self.first is not None:
            first, self.first = self.first, None
            yield first
        async for batch in self.events:
            yield batch

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """The choices' deltas one by one, each accounted for usage and latency."""
        async for batch in self.batches():
            kept, failure = self._account(batch)
            for item in kept:
                yield item
            if failure is not None:
                raise failure

    def _account(self, batch: list[tuple[int, Delta]]) -> tuple[list[tuple[int, Delta]], EngineError | None]:
        """Usage, finish reason and token latency for one batch.

        Returns the deltas up to an engine abort, and the abort as an error. Latency is taken once per
        batch: the time since a choice's previous batch is spread over the tokens it brought.
        """
        tokens: dict[int, int] = {}
        for position, (index, delta) in enumerate(batch):
            self.usage[index].observe(delta)
            if delta.finish_reason is not None:
                if delta.finish_reason == FinishReason.ABORT:
                    self._timed(tokens)
                    return batch[:position], EngineError("The engine aborted the generation", 500)
                self.finish_reason = str(delta.finish_reason)
            if delta.token_ids:
                tokens[index] = tokens.get(index, 0) + len(delta.token_ids)
        self._timed(tokens)
        return batch, None

    def _timed(self, tokens: dict[int, int]) -> None:
        if not tokens:
            return
        now = time.monotonic()
        metrics = self.server.metrics
        if not self.first_token_seen:
            self.first_token_seen = True
            metrics.ttft.observe(now - self.started)
        for index, count in tokens.items():
            previous = self.last_token_at.get(index)
            if previous is None:  # a choice's first token has no inter-token gap
                metrics.observe_tokens(now - self.started, count - 1)
            else:
                metrics.observe_tokens(now - previous, count)
            self.last_token_at[index] = now

    async def close(self) -> None:
        """Abort whatever still runs, release capacity, and record usage for every outcome."""
        if self.closed:
            return
        self.closed = True
        try:
            await self.events.aclose()  # type: ignore[attr-defined]
        finally:
            self.server.release(self.job)
            metrics = self.server.metrics
            metrics.record_request(self.job.endpoint, self.outcome, self.finish_reason)
            metrics.record_usage(request_usage(self.usage))
            metrics.e2e.observe(time.monotonic() - self.started)

    # ---- the two response forms

    async def stream(self) -> AsyncIterator[bytes]:
        job = self.job
        render = EventRenderer(job, self.usage)
        try:
            # One write per batch: when the client lags, the deltas that piled up go out together,
            # each still its own `data:` event, in order.
            async for batch in self.batches():
                kept, failure = self._account(batch)
                out: list[bytes] = []
                for index, delta in kept:
                    render(out, index, delta)
                if out:
                    yield b"".join(out)
                if failure is not None:
                    raise failure
            if job.include_usage:
                yield sse.event(render.chunks.usage(request_usage(self.usage).as_openai()))
            self.outcome = names.OUTCOME_OK
            yield sse.DONE
        except EngineError as err:
            self.outcome = names.OUTCOME_ERROR
            log.warning("Generation %s failed mid-stream: %s", job.header.id, err.message)
            yield sse.error_event(err.message, code=err.status_code)
            yield sse.DONE
        except Exception:
            self.outcome = names.OUTCOME_ERROR
            log.exception("Generation %s failed mid-stream", job.header.id)
            yield sse.error_event("Internal error while generating")
            yield sse.DONE
        finally:
            await self.close()

    async def collect(self) -> dict[str, Any]:
        job = self.job
        results = [ChoiceResult(i) for i in range(job.generations)]
        texts: list[list[str]] = [[] for _ in results]
        try:
            async for index, delta in self.deltas():
                texts[index].append(delta.text)
                if delta.logprobs is not None:
                    results[index].logprobs = [*(results[index].logprobs or []), *delta.logprobs]
                if delta.finish_reason is not None:
                    results[index].finish_reason = str(delta.finish_reason)
            self.outcome = names.OUTCOME_OK
        except EngineError as err:
            self.outcome = names.OUTCOME_ERROR
            raise ApiError(err.status_code if err.status_code >= 400 else 500, err.message) from None
        finally:
            await self.close()
        for result, parts in zip(results, texts, strict=True):
            prefix = job.prompt_texts[result.index // job.n] if job.echo else ""
            result.text = prefix + "".join(parts)
        usage = request_usage(self.usage).as_openai()
        if job.endpoint == CHAT:
            return chat_response(job.header, results, usage)
        return completion_response(job.header, results, usage)


class EventRenderer:
    """A stream's deltas as SSE events: the first chunk of each choice (role, echo) and chunks carrying a
    finish reason, logprobs or running usage go through the chunk dicts; a plain text delta, the bulk of
    any stream, is written through a byte template cut from that same dict path (`sse.text_template`)."""

    def __init__(self, job: Job, usage: Sequence[ChoiceUsage]) -> None:
        self.job = job
        self.usage = usage
        self.chunks: CompletionChunks | ChatChunks = (
            ChatChunks(job.header) if job.endpoint == CHAT else CompletionChunks(job.header)
        )
        self.opened: set[int] = set()
        # Per opened choice, unless every chunk carries running usage (then no two chunks share bytes).
        self.templates: dict[int, Callable[[str], bytes]] = {}

    def __call__(self, out: list[bytes], index: int, delta: Delta) -> None:
        """Append the events of one delta to `out`."""
        template = self.templates.get(index)
        if template is not None and delta.finish_reason is None and delta.logprobs is None:
            if delta.text:
                out.append(template(delta.text))
            return
        out.extend(sse.event(event) for event in self._dicts(index, delta))

    def _dicts(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        job = self.job
        events: list[dict[str, Any]] = []
        running = self.usage[index].running_usage() if job.continuous_usage else None
        text = delta.text
        if index not in self.opened:
            self.opened.add(index)
            template = None if job.continuous_usage else sse.text_template(
                self.chunks.content(index, sse.TEXT_MARK, None, None))
            if template is not None:
                self.templates[index] = template
            if isinstance(self.chunks, ChatChunks):
                events.append(self.chunks.role(index, running))
            elif job.echo:
                text = job.prompt_texts[index // job.n] + text
        if text or delta.finish_reason is not None or delta.logprobs:
            finish = str(delta.finish_reason) if delta.finish_reason is not None else None
            events.append(self.chunks.content(index, text, delta.logprobs, finish, running))
        return events


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

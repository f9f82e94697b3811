"""The Engine port: what serving code needs from any engine, and the normalized delta it yields.

Every adapter (llama.cpp on the CPU, SGLang on GPUs) turns its native output into one
stream of `Delta`s per generated choice (directly, or as an `ItemStream`: the engine's own items and the
conversion of each). A delta may carry several tokens (engines coalesce),
no text at all (a partial UTF-8 character, an EOS token), and the engine's own cumulative
counts, which include stop and EOS tokens. See SGLANG_CONTRACT.md §2 and §8.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec


class StreamMode(enum.StrEnum):
    """How the engine underneath streams: disjoint deltas or the whole output so far."""

    INCREMENTAL = "incremental"
    CUMULATIVE = "cumulative"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling parameters in engine terms. `max_tokens` is always set (OpenAI's default is 16)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of alternatives per token; None = no logprobs
    json_schema: str | None = None  # the output is constrained to JSON matching it (the engine's grammar)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One choice to generate. `request_id` is unique and never a prefix of another id."""

    request_id: str
    prompt_ids: Sequence[int]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


class Delta(msgspec.Struct, frozen=True, gc=False):
    """A piece of one choice's output, already converted to deltas.

    Counts are the engine's own cumulative values as of this delta (None when the engine did
    not report them); `finish_reason` is set on the last delta only. One is built per engine item,
    so it is a msgspec Struct: immutable, and built in C in a fifth of a slotted dataclass's time
    (benchmarks/README.md, relay). `gc=False`: it holds only strings, numbers and tuples of them.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    finish_reason: FinishReason | None = None
    # Token ids the engine counted in `completion_tokens` but did not send (SGLang <= 0.5.9 keeps only
    # the newest ids of a backlog, SGLANG_CONTRACT.md §3): known loss, not a usage mismatch.
    dropped_ids: int = 0


class EngineError(Exception):
    """The engine failed this request. `status_code` says whose fault it was (4xx: the client's)."""

    def __init__(self, message: str, status_code: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        # The engine's last item, when the failure came with one (an SGLang abort with a status carries the
        # step's token and its counts): billed when the run closes, never relayed
        self.final: Delta | None = None


class InvalidRequestError(EngineError):
    """The engine rejected the request before producing anything (HTTP 400 before the first byte)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, 400)
        self.param = param


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine serves, read once the engine has started."""

    model_path: str
    context_length: int
    vocab_size: int
    stream_mode: StreamMode = StreamMode.INCREMENTAL
    engine_kind: str = "unknown"
    # Tokens the engine spent on its own start-up probe: in its counters, never in any client's usage.
    probe_prompt_tokens: int = 0
    probe_completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What an adapter needs to start its engine: the engine's part of the runtime's settings."""

    model_path: str = ""  # empty: the adapter's default (the embedded GGUF for the CPU engine)
    served_model_name: str = "smollm2-135m-instruct"
    context_length: int = 2048
    slots: int = 4  # generations at once (the CPU engine keeps one context each)
    cpu_threads: int = 0
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    mem_fraction_static: float = 0.0
    max_running_requests: int = 0
    trust_remote_code: bool = False
    log_level: str = "info"
    engine_args: tuple[str, ...] = ()
    allow_cumulative_stream: bool = False


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """An engine's own series for /metrics (Prometheus text), and its own token totals where it keeps any:
    the runtime reports the drift between those and the engine-sourced usage it counted itself."""

    text: bytes = b""
    prompt_tokens: float | None = None
    completion_tokens: float | None = None


@dataclass(frozen=True, slots=True)
class CacheLoad:
    """What a gateway's endpoint picker reads of the engine (the model-server protocol's gauges): requests in
    the engine's own queue (beyond the runtime's admission queue), the fraction of the KV cache in use, and
    the cache's shape in pages."""

    queued: float = 0.0
    kv_usage: float = 0.0  # 0 to 1
    page_size: int = 1  # tokens per page
    num_pages: int = 0


@dataclass(frozen=True, slots=True)
class Health:
    ok: bool
    reason: str = ""


class ItemStream:
    """One choice as the engine's own items plus the adapter's conversion of each into a delta.

    What an adapter whose engine streams something else than deltas (SGLang's dicts) returns from
    `generate`: the fan-in pump (`fanin.Choices`) then reads the items and converts each in its own loop,
    so the adapter adds no async-generator layer per item, which at thousands of streams costs as much as
    the conversion (benchmarks/README.md §1). Any other reader iterates it as deltas (`deltas`), with
    the same semantics; the pump's loop must keep them.
    """

    convert: Callable[[Any], Delta]  # one item as a delta; raises an EngineError for one that ends the choice

    async def open(self) -> AsyncIterator[Any]:
        """Start the generation: the engine's iterator of items (`close` follows even if this raises)."""
        raise NotImplementedError

    def first_item(self) -> None:
        """The engine's first item has arrived (called before it is converted)."""

    def failed(self, error: Exception, started: bool) -> Exception:
        """What the choice fails with when the engine (or `convert`) raised `error`; `started`: after the
        first item."""
        return error

    async def close(self, finished: bool) -> None:
        """End the generation: abort it in the engine unless it `finished` (a delta with a finish reason
        was converted), and close the items' iterator."""
        raise NotImplementedError

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self.deltas()

    async def deltas(self) -> AsyncIterator[Delta]:
        """The choice as deltas, up to and including the one with a finish reason."""
        started = finished = False
        try:
            async for item in await self.open():
                if not started:
                    started = True
                    self.first_item()
                delta = self.convert(item)
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        except Exception as error:
            raise self.failed(error, started) from None
        finally:
            await self.close(finished)


class Engine(Protocol):
    """The port serving code depends on. Adapters are imported lazily behind extras."""

    async def start(self) -> EngineInfo: ...

    async def stop(self) -> None: ...

    def health(self) -> Health: ...

    def own_metrics(self) -> EngineMetrics:
        """The engine's own series and token totals (empty for an engine that keeps none)."""
        ...

    def cache_load(self) -> CacheLoad:
        """The engine's queue and KV cache now, for the model-server gauges (cheap: read per scrape)."""
        ...

    def tokenize(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids as the engine would see this prompt text (including any BOS it adds, unless
        `add_special_tokens` is False: a rendered chat template already holds its own). With `parse_special`
        False, text that spells a special token (`<|im_start|>`, say) is tokenized as plain text: chat message
        content must never become a role or control token."""
        ...

    def detokenize(self, ids: Sequence[int]) -> str: ...

    def control_tokens(self) -> frozenset[str]:
        """The texts `tokenize` reads as control tokens only with `parse_special`: client text outside message
        content that spells one would become one (prepare.py refuses it). Known once the engine has started."""
        ...

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for a chat conversation, with the model's template and generation prompt (and the
        tools offered, for a template that shows them)."""
        ...

    def tool_parser(self, tools: list[dict[str, Any]]) -> Callable[[str], tuple[str, list[tuple[str, str]]]] | None:
        """The engine's own parser of the model family's tool calls in free text, for these tools (None: the
        engine has none, and `tool_choice: auto` is refused): text -> (text around the calls, [(name, args)])."""
        ...

    async def check_json_schema(self, schema: str) -> None:
        """Raise ValueError, saying why, if the engine's grammar backend cannot (or may not: grammar.py's bounds)
        constrain output to `schema` (JSON text). Called before a request is admitted, never on the event loop's
        time or in the serving process's memory; the engine compiles it again when it generates."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta] | ItemStream:
        """Yield deltas for one choice until a delta with `finish_reason` (or return an `ItemStream`).

        Raise `InvalidRequestError` before the first delta for requests the engine refuses,
        `EngineError` at any point for failures. Closing the iterator aborts the generation.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Stop one generation soon, without closing its iterator: the iterator then ends with a delta
        whose finish reason is ABORT and that carries the engine's final counts (what it generated for
        the choice, also past the last delta read). A no-op for a generation that already ended."""
        ...

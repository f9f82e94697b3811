"""SGLang adapter: an in-process `sglang.Engine` with incremental streaming on, checked before serving.

`sglang` is imported lazily (extra `sglang`), so nothing else needs it. Start-up: detect the generation,
construct the Engine with the streaming switch as a constructor argument, read back the effective mode,
then run a behavioural probe. `/health` stays 503 with the reason unless SGLang streams incrementally or
cumulative mode was explicitly allowed (then deltas are still computed correctly and `/metrics` says
`cumulative`). All engine calls stay on the serving event loop (SGLANG_CONTRACT.md §6).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import importlib.util
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from tally_runtime import contract
from tally_runtime.engine import sglang_compat as compat
from tally_runtime.engine.base import (
    CacheLoad,
    EngineConfig,
    EngineError,
    EngineInfo,
    EngineMetrics,
    GenerationRequest,
    Health,
    InvalidRequestError,
    ItemStream,
    SamplingParams,
    StreamMode,
)
from tally_runtime.engine.sglang_metrics import engine_gauges, sglang_metrics, sglang_series
from tally_runtime.engine.sglang_stream import ChoiceStream, StreamModeViolation, StreamShape
from tally_runtime.grammar import GrammarWorker

log = logging.getLogger("tally_runtime.engine.sglang")

PROBE_TOKENS = 8
LOAD_SECONDS = 0.5  # SGLang's gauges are read from its files at most this often (cache_load)
PROBE_TIMEOUT_SECONDS = 120.0


def sampling_params(params: SamplingParams) -> dict[str, Any]:
    """OpenAI sampling in SGLang's terms; max_new_tokens is always passed (SGLang's default is 128)."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "ignore_eos": params.ignore_eos,
        "min_new_tokens": params.min_tokens,
        "skip_special_tokens": True,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    if params.json_schema is not None:  # SGLang's grammar backend (xgrammar by default) constrains it
        out["json_schema"] = params.json_schema
    return out


def base_kwargs(settings: EngineConfig) -> dict[str, Any]:
    """Engine arguments from our settings plus the pass-through ones (already parsed to keyword form)."""
    if not settings.model_path:
        raise ValueError("--model-path is required with --engine sglang (an HF checkpoint directory)")
    kwargs: dict[str, Any] = {
        "model_path": settings.model_path,
        "served_model_name": settings.served_model_name,
        "context_length": settings.context_length,
        "tp_size": settings.tensor_parallel_size,
        "dp_size": settings.data_parallel_size,
        "trust_remote_code": settings.trust_remote_code,
        "enable_metrics": True,
        "enable_cache_report": True,
        "log_level": settings.log_level,
    }
    if settings.mem_fraction_static:
        kwargs["mem_fraction_static"] = settings.mem_fraction_static
    if settings.max_running_requests:
        kwargs["max_running_requests"] = settings.max_running_requests
    return kwargs


# SGLang's xgrammar lets constrained JSON have any run of whitespace between tokens: a small model at a
# temperature can spend a request's whole max_tokens on it (billed, and the output cut unparseable). Tally
# bounds each run, as llama.cpp's converter does (one space); spec.engine.args may set another bound or
# --constrained-json-disable-any-whitespace.
JSON_WHITESPACE_RUN = 16


def tally_defaults(server_args_cls: Any) -> dict[str, Any]:
    """Tally's own defaults for options a service may still set, where this generation declares them."""
    if "constrained_json_max_whitespace_cnt" in compat.declared_fields(server_args_cls):
        return {"constrained_json_max_whitespace_cnt": JSON_WHITESPACE_RUN}
    return {}


def parse_pass_through(server_args_cls: Any, args: Sequence[str]) -> dict[str, Any]:
    """Turn pass-through CLI arguments into constructor arguments with SGLang's own parser, abbreviations
    off: every item that starts with `-` must be one of SGLang's options by its full name (`--name` or
    `--name=value`), so no item can be read as an option it does not spell out."""
    import argparse

    if not args:
        return {}
    parser = argparse.ArgumentParser(prog="sglang", add_help=False, allow_abbrev=False, exit_on_error=False)
    server_args_cls.add_cli_args(parser)
    options = {s for action in parser._actions for s in action.option_strings}
    unknown = [a for a in args if a.startswith("-") and a.split("=", 1)[0] not in options]
    if unknown:
        raise ValueError(f"not SGLang options (full names only, one per argument): {', '.join(map(repr, unknown))}")
    try:
        defaults = vars(parser.parse_args(["--model-path", "unused"]))
        given = vars(parser.parse_args(["--model-path", "unused", *args]))
    except (argparse.ArgumentError, SystemExit) as err:
        raise ValueError(f"SGLang refused the engine arguments: {err}") from None
    return {k: v for k, v in given.items() if v != defaults.get(k) and k != "model_path"}


class SGLangEngine:
    def __init__(self, settings: EngineConfig) -> None:
        self.settings = settings
        self._engine: Any = None
        self._shape = StreamShape(ids_cumulative=False, text_cumulative=False)
        self._health = Health(False, "engine is starting")
        self._tokenizer: Any = None
        self._probe_usage = (0, 0)
        self._abort_wanted: set[str] = set()  # aborts asked for; re-sent once SGLang knows the request
        self.generation: compat.Generation | None = None
        self._load: tuple[float, CacheLoad] = (-1e9, CacheLoad())
        self._grammar: GrammarWorker | None = None  # made at the first schema, for the backend SGLang runs

    # ---- lifecycle

    async def start(self) -> EngineInfo:
        sglang = importlib.import_module("sglang")
        server_args_cls = importlib.import_module("sglang.srt.server_args").ServerArgs
        version = str(getattr(sglang, "__version__", "") or importlib.metadata.version("sglang"))
        self.generation = compat.detect_generation(server_args_cls, version)
        passed = compat.split_engine_args(self.settings.engine_args)
        kwargs = compat.engine_kwargs(
            server_args_cls, {**tally_defaults(server_args_cls), **parse_pass_through(server_args_cls, passed),
                              **base_kwargs(self.settings)},
        )
        log.info("Starting SGLang %s (generation %s) with %s=True", version, self.generation,
                 compat.streaming_field(server_args_cls))
        self._engine = sglang.Engine(**kwargs)
        manager = self._engine.tokenizer_manager
        self._tokenizer = manager.tokenizer
        declared = compat.expected_shape(self.generation, incremental=True)
        effective = compat.effective_incremental(self._engine, _get_serving())
        self._shape = await self._probe(declared)  # what really arrives decides how items are read
        probed = self._shape
        as_declared = (probed.ids_cumulative, probed.text_cumulative) == (declared.ids_cumulative,
                                                                          declared.text_cumulative)
        self._health = self._verdict(declared, effective, probed)
        # "incremental" = the switch is in force: the generation streams what it streams with it on
        # (generations A/B keep cumulative text even then; the adapter slices it).
        mode = StreamMode.INCREMENTAL if as_declared and effective is not False else StreamMode.CUMULATIVE
        return EngineInfo(
            model_path=self.settings.model_path, context_length=int(manager.context_len),
            vocab_size=int(getattr(manager.model_config, "vocab_size", 0) or len(self._tokenizer)),
            stream_mode=mode, engine_kind=f"sglang-{version}",
            probe_prompt_tokens=self._probe_usage[0], probe_completion_tokens=self._probe_usage[1],
        )

    def _verdict(self, declared: StreamShape, effective: bool | None, probed: StreamShape) -> Health:
        if effective is False:
            reason = "SGLang reports incremental streaming off although it was requested"
        elif (probed.ids_cumulative, probed.text_cumulative) != (declared.ids_cumulative, declared.text_cumulative):
            reason = (f"SGLang streams ids {'cumulatively' if probed.ids_cumulative else 'as deltas'} and text "
                      f"{'cumulatively' if probed.text_cumulative else 'as deltas'}, not as generation "
                      f"{self.generation} with incremental streaming does")
        else:
            return Health(True)
        if self.settings.allow_cumulative_stream:
            log.warning("%s; serving anyway (cumulative streaming allowed)", reason)
            return Health(True)
        log.error("%s; /health stays 503", reason)
        return Health(False, reason)

    async def _probe(self, declared: StreamShape) -> StreamShape:
        """Stream a few greedy tokens with logprobs and look at what actually arrives (§1.4-5)."""
        ids = self.tokenize("The quick brown fox")
        params = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0, ignore_eos=True)
        items: list[compat.ProbeItem] = []
        prompt_tokens = 0
        generator = await self._engine.async_generate(
            input_ids=ids, sampling_params=sampling_params(params), stream=True, rid="tally-probe.",
            return_logprob=True, top_logprobs_num=0)
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_SECONDS):
                async for item in generator:
                    meta = item.get("meta_info") or {}
                    prompt_tokens = int(meta.get("prompt_tokens") or prompt_tokens)
                    items.append(compat.ProbeItem(
                        item.get("text") or "", tuple(item.get("output_ids") or ()),
                        int(meta.get("completion_tokens") or 0), len(meta.get("output_token_logprobs") or ())))
        finally:
            await generator.aclose()
        self._probe_usage = (prompt_tokens, items[-1].completion_tokens if items else 0)
        shape = compat.probe_shape(items, declared)
        # Knowing how ids arrive, the decoded ids are the whole text: the text check can use it.
        all_ids = items[-1].output_ids if shape.ids_cumulative else tuple(i for it in items for i in it.output_ids)
        return compat.probe_shape(items, declared, full_text=self.detokenize(all_ids) if items else None)

    async def stop(self) -> None:
        self._health = Health(False, "engine stopped")
        if self._engine is not None:
            self._engine.shutdown()
        if self._grammar is not None:
            await self._grammar.close()

    def health(self) -> Health:
        return self._health

    def own_metrics(self) -> EngineMetrics:
        return sglang_metrics()

    def cache_load(self) -> CacheLoad:
        """SGLang's own queue and KV use (its scheduler's gauges, read at most every LOAD_SECONDS: a picker
        scrapes many times a second) and its cache's shape: `page_size` tokens a page, and the token pool
        its scheduler sized at start (`max_total_num_tokens`) in pages."""
        at = time.monotonic()
        if at - self._load[0] < LOAD_SECONDS:
            return self._load[1]
        gauges = engine_gauges(sglang_series().decode(), (contract.SGLANG_QUEUE_GAUGES[0],
                                                          contract.SGLANG_KV_CACHE_USAGE))
        args = getattr(self._engine, "server_args", None)
        page_size = int(getattr(args, "page_size", None) or 1)
        infos = getattr(getattr(self._engine, "_scheduler_init_result", None), "scheduler_infos", None) or [{}]
        tokens = int(infos[0].get("max_total_num_tokens") or 0) if isinstance(infos[0], dict) else 0
        load = CacheLoad(gauges.get(contract.SGLANG_QUEUE_GAUGES[0], 0.0),
                         gauges.get(contract.SGLANG_KV_CACHE_USAGE, 0.0), page_size, tokens // page_size)
        self._load = (at, load)
        return load

    # ---- text

    def tokenize(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        if parse_special:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True))

    def detokenize(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))

    def control_tokens(self) -> frozenset[str]:
        """The special tokens `split_special_tokens` keeps as text (every other added token is parsed either way)."""
        added = getattr(self._tokenizer, "added_tokens_decoder", None) or {}
        special = {str(t.content) for t in added.values() if getattr(t, "special", False)}
        return frozenset(special | {str(t) for t in getattr(self._tokenizer, "all_special_tokens", ())})

    def _piece(self, token: int) -> str:
        return self.detokenize([token])

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        render = self._tokenizer.apply_chat_template
        if tools:
            try:
                return str(render(list(messages), tools=tools, tokenize=False, add_generation_prompt=True))
            except TypeError:  # a tokenizer older than transformers 4.42 takes no tools: the call is constrained
                pass  # by the grammar all the same, the template just does not show the tools
        return str(render(list(messages), tokenize=False, add_generation_prompt=True))

    def tool_parser(self, tools: list[dict[str, Any]]) -> Callable[[str], tuple[str, list[tuple[str, str]]]] | None:
        """SGLang's FunctionCallParser for `--tool-call-parser` (spec.engine.args), if one was given."""
        name = getattr(getattr(self._engine, "server_args", None), "tool_call_parser", None)
        if not name:
            return None
        module = importlib.import_module("sglang.srt.function_call.function_call_parser")
        protocol = importlib.import_module("sglang.srt.entrypoints.openai.protocol")
        given = [protocol.Tool.model_validate(tool) for tool in tools]
        try:
            module.FunctionCallParser(given, name)
        except ValueError:  # a name SGLang resolved otherwise ("auto"), or one this version lacks
            log.warning("SGLang has no tool-call parser %r: tool_choice auto is refused", name)
            return None

        def parse(text: str) -> tuple[str, list[tuple[str, str]]]:
            normal, calls = module.FunctionCallParser(given, name).parse_non_stream(text)
            return str(normal), [(str(c.name), str(c.parameters)) for c in calls if c.name]

        return parse

    async def check_json_schema(self, schema: str) -> None:
        """What SGLang's scheduler would do with it, done before admission in a process of its own (grammar.py):
        xgrammar (its default grammar backend) compiles the schema; under another backend it is held to the
        bounds only, and SGLang compiles it when the request runs."""
        if self._grammar is None:
            backend = getattr(getattr(self._engine, "server_args", None), "grammar_backend", None) or "xgrammar"
            if backend == "none":
                raise ValueError("this server's SGLang runs without a grammar backend (--grammar-backend none)")
            if backend == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
                backend = "xgrammar-missing"  # bounds only: SGLang reports what it cannot compile
            self._grammar = GrammarWorker(backend)
        await self._grammar.check(schema)

    # ---- generation

    def abort(self, request_id: str) -> None:
        """SGLang ends the request at its next step with a graceful-abort item that carries its final counts
        (SGLANG_CONTRACT.md §2.5); the tokenizer manager's abort works on every generation and is a no-op for
        a request that has already finished."""
        if self._engine is not None:
            self._abort_wanted.add(request_id)
            self._engine.tokenizer_manager.abort_request(request_id)

    def generate(self, request: GenerationRequest) -> ItemStream:
        return _Generation(self, request)

    def _failed(self, request_id: str, error: Exception, started: bool) -> Exception:
        if isinstance(error, StreamModeViolation):
            self._health = Health(False, error.message)
            return error
        if isinstance(error, ValueError):  # SGLang validates on the first iteration (§2)
            if not started:  # SGLang's own validation: its words are for the client
                return InvalidRequestError(str(error))
            log.error("SGLang failed generating %s: %s", request_id, error)
            return EngineError("The engine failed while generating")
        return error


class _Generation(ItemStream):
    """One SGLang generation: SGLang's own items, converted one by one (`ChoiceStream.convert`)."""

    def __init__(self, adapter: SGLangEngine, request: GenerationRequest) -> None:
        self.adapter = adapter
        self.request = request
        self.want_logprobs = request.sampling.logprobs is not None
        self.convert = ChoiceStream(adapter._shape, adapter._piece, self.want_logprobs).convert
        self.generator: Any = None

    async def open(self) -> AsyncIterator[Any]:
        params = self.request.sampling
        self.generator = await self.adapter._engine.async_generate(
            input_ids=list(self.request.prompt_ids), sampling_params=sampling_params(params), stream=True,
            return_logprob=self.want_logprobs, top_logprobs_num=params.logprobs if self.want_logprobs else None,
            rid=self.request.request_id,
        )
        return self.generator  # type: ignore[no-any-return]

    def first_item(self) -> None:
        if self.request.request_id in self.adapter._abort_wanted:
            # asked before SGLang had registered the request, when abort_request is a no-op
            self.adapter._engine.tokenizer_manager.abort_request(self.request.request_id)

    def failed(self, error: Exception, started: bool) -> Exception:
        return self.adapter._failed(self.request.request_id, error, started)

    async def close(self, finished: bool) -> None:
        rid = self.request.request_id
        self.adapter._abort_wanted.discard(rid)
        if not finished:
            # Closing the generator aborts the request only from 0.5.20 on; before that the scheduler ran
            # it to max_tokens for nobody. The tokenizer manager's abort works on every generation (and is
            # a no-op for a request that has already finished).
            self.adapter._engine.tokenizer_manager.abort_request(rid)
        if self.generator is not None:
            await self.generator.aclose()


def _get_serving() -> Any:
    try:
        return importlib.import_module("sglang.srt.runtime_context").get_serving
    except (ImportError, AttributeError):
        return None

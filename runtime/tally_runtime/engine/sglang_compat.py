"""Every SGLang generation of the incremental-streaming switch: detection, setting, verification.

| gen | versions      | ServerArgs     | field                        | text        | ids                 |
|-----|---------------|----------------|------------------------------|-------------|---------------------|
| A   | <= 0.5.5      | dataclass      | stream_output                | cumulative  | always delta        |
| B   | 0.5.6-0.5.9   | dataclass      | stream_output                | cumulative  | delta iff the field |
| C   | 0.5.10-0.5.19 | dataclass      | incremental_streaming_output | delta iff the field | same        |
| D   | >= 0.5.20     | msgspec Struct | incremental_streaming_output | delta iff the field | same        |

The field is chosen from the fields the class *declares* and passed to the constructor: assigning an
attribute after construction silently did nothing once the field was renamed (SGLANG_CONTRACT.md §1, §5).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from tally_runtime.engine.sglang_stream import StreamShape

INCREMENTAL_FIELD = "incremental_streaming_output"
LEGACY_FIELD = "stream_output"
CLI_FLAGS = {INCREMENTAL_FIELD: "--incremental-streaming-output", LEGACY_FIELD: "--stream-output"}

# Arguments Tally sets itself; passing them through --engine-args would contradict the runtime.
OWNED_ARGS = frozenset({
    "--model-path", "--model", "--tokenizer-path", "--served-model-name", "--host", "--port",
    "--skip-tokenizer-init", "--context-length", "--tp-size", "--tensor-parallel-size", "--dp-size",
    "--data-parallel-size", "--enable-metrics", "--enable-cache-report", "--trust-remote-code",
    "--mem-fraction-static", "--max-running-requests",
})


class Generation(enum.StrEnum):
    A = "A"
    B = "B"
    C = "C"
    D = "D"


class UnsupportedSGLang(RuntimeError):
    pass


def declared_fields(server_args_cls: type) -> tuple[str, ...]:
    """Fields the class declares: msgspec Structs (0.5.20+) or dataclasses (older). Never `hasattr`."""
    struct_fields = getattr(server_args_cls, "__struct_fields__", None)
    if struct_fields is not None:
        return tuple(struct_fields)
    return tuple(getattr(server_args_cls, "__dataclass_fields__", {}))


def streaming_field(server_args_cls: type) -> str:
    names = declared_fields(server_args_cls)
    for field in (INCREMENTAL_FIELD, LEGACY_FIELD):
        if field in names:
            return field
    raise UnsupportedSGLang(f"{server_args_cls.__name__} declares neither {INCREMENTAL_FIELD} nor {LEGACY_FIELD}")


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def detect_generation(server_args_cls: type, version: str) -> Generation:
    field = streaming_field(server_args_cls)
    if field == INCREMENTAL_FIELD:
        return Generation.D if hasattr(server_args_cls, "__struct_fields__") else Generation.C
    # Both A and B declare stream_output; B starts with the output_ids fix after 0.5.5 (PR #13759).
    return Generation.A if (version_tuple(version) or (0,)) <= (0, 5, 5) else Generation.B


def expected_shape(generation: Generation, incremental: bool) -> StreamShape:
    """What the contract says each generation streams, given the switch."""
    if generation is Generation.A:
        return StreamShape(ids_cumulative=False, text_cumulative=True, logprobs_cumulative=True)
    if generation is Generation.B:
        return StreamShape(ids_cumulative=not incremental, text_cumulative=True, logprobs_cumulative=True)
    return StreamShape(ids_cumulative=not incremental, text_cumulative=not incremental,
                       logprobs_cumulative=not incremental)


def cli_flag(server_args_cls: type) -> str:
    return CLI_FLAGS[streaming_field(server_args_cls)]


@dataclass(frozen=True, slots=True)
class PassThrough:
    """Extra SGLang CLI arguments, with the streaming switch pulled out (it is set as a constructor argument)."""

    args: tuple[str, ...]
    incremental_requested: bool


def split_engine_args(args: Sequence[str]) -> PassThrough:
    """Reject arguments Tally owns; accept either generation's streaming flag (the CLI form)."""
    rest: list[str] = []
    incremental = False
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in OWNED_ARGS:
            raise ValueError(f"{name} is set by Tally and cannot be passed through engine args; "
                             "use the runtime's own flag or the CompletionService spec instead")
        if name in CLI_FLAGS.values():
            incremental = True
            continue
        rest.append(arg)
    return PassThrough(tuple(rest), incremental)


def engine_kwargs(server_args_cls: type, base: Mapping[str, Any], incremental: bool = True) -> dict[str, Any]:
    """Constructor arguments for `sglang.Engine`, with the streaming switch under the name this class declares."""
    return {**base, streaming_field(server_args_cls): incremental}


def effective_incremental(engine: Any, get_serving: Any = None) -> bool | None:
    """What the running engine actually uses, most authoritative source first (§1.4-4); None if unknown."""
    manager = getattr(engine, "tokenizer_manager", None)
    value = getattr(manager, INCREMENTAL_FIELD, None)
    if isinstance(value, bool):
        return value
    if get_serving is not None:
        try:
            return bool(getattr(get_serving(), INCREMENTAL_FIELD))
        except (ValueError, AttributeError):
            pass
    server_args = getattr(engine, "server_args", None)
    for field in (INCREMENTAL_FIELD, LEGACY_FIELD):
        if field in declared_fields(type(server_args)):
            return bool(getattr(server_args, field))
    return None


@dataclass(frozen=True, slots=True)
class ProbeItem:
    text: str
    output_ids: tuple[int, ...]
    completion_tokens: int


def probe_shape(items: Sequence[ProbeItem]) -> StreamShape:
    """Behavioural check (§1.4-5) on a short greedy stream: which fields arrived cumulative?

    Cumulative ids: every item holds all ids so far (`len == completion_tokens`) and the stream had more
    than one token per item at some point. Cumulative text: each item's text extends the previous one.
    """
    if not items:
        raise UnsupportedSGLang("the start-up probe received no output")
    final = items[-1].completion_tokens
    lengths = [len(i.output_ids) for i in items]
    ids_cumulative = len(items) > 1 and all(n == i.completion_tokens for n, i in zip(lengths, items, strict=True)) \
        and sum(lengths) > final
    texts = [i.text for i in items if i.text]
    text_cumulative = len(texts) > 1 and all(b.startswith(a) and len(b) > len(a) for a, b in pairwise(texts))
    return StreamShape(ids_cumulative=ids_cumulative, text_cumulative=text_cumulative)

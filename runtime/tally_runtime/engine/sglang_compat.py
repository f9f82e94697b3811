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

from tally_runtime.contract import OWNED_ENGINE_ARGS, STREAMING_FLAGS
from tally_runtime.engine.sglang_stream import StreamShape

INCREMENTAL_FIELD = "incremental_streaming_output"
LEGACY_FIELD = "stream_output"


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
    """What the contract says each generation streams, given the switch. Generations A/B keep only the
    newest delta ids of a backlog (§3); C/D concatenate them. Logprob lists: the probe decides (0.5.10
    still sent them cumulatively in incremental mode, §1.1), the generation is only the default."""
    if generation is Generation.A:
        return StreamShape(ids_cumulative=False, text_cumulative=True, logprobs_cumulative=True,
                           drops_backlog_ids=True)
    if generation is Generation.B:
        return StreamShape(ids_cumulative=not incremental, text_cumulative=True, logprobs_cumulative=True,
                           drops_backlog_ids=incremental)
    return StreamShape(ids_cumulative=not incremental, text_cumulative=not incremental,
                       logprobs_cumulative=not incremental)


def split_engine_args(args: Sequence[str]) -> tuple[str, ...]:
    """Reject arguments Tally owns; drop either generation's streaming flag (the CLI form of what the
    adapter always sets as a constructor argument, so it is harmless to repeat)."""
    rest: list[str] = []
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in OWNED_ENGINE_ARGS:  # (an abbreviation is no full option name: parse_pass_through refuses it)
            raise ValueError(f"{name} is set by Tally and cannot be passed through engine args; "
                             "use the runtime's own flag or the CompletionService spec instead")
        if name not in STREAMING_FLAGS:
            rest.append(arg)
    return tuple(rest)


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
    logprobs: int = 0  # entries in this item's output_token_logprobs


def probe_shape(items: Sequence[ProbeItem], declared: StreamShape, full_text: str | None = None) -> StreamShape:
    """Behavioural check (§1.4-5) on a short greedy stream with logprobs: which fields arrived cumulative?

    Ids (and logprob lists): cumulative when every item holds as many entries as tokens so far and some
    item held more than one. Text: cumulative when the last item is the whole text and the items grow as
    prefixes; deltas when the items add up to it. Items that add no printable text (part of a multi-byte
    character, a skipped special token) fit either reading. `full_text` is the decoded ids; where the
    stream cannot tell (one item, say), the declared shape stands.
    """
    if not items:
        raise UnsupportedSGLang("the start-up probe received no output")
    return StreamShape(
        ids_cumulative=_lists_cumulative([len(i.output_ids) for i in items], items),
        text_cumulative=_text_cumulative([i.text for i in items if i.text], full_text, declared.text_cumulative),
        logprobs_cumulative=(_lists_cumulative([i.logprobs for i in items], items)
                             if any(i.logprobs for i in items) else declared.logprobs_cumulative),
        drops_backlog_ids=declared.drops_backlog_ids,
    )


def _lists_cumulative(lengths: Sequence[int], items: Sequence[ProbeItem]) -> bool:
    final = items[-1].completion_tokens
    return len(items) > 1 and sum(lengths) > final and all(
        n == i.completion_tokens for n, i in zip(lengths, items, strict=True))


def _text_cumulative(texts: Sequence[str], full_text: str | None, default: bool) -> bool:
    growing = all(b.startswith(a) for a, b in pairwise(texts))
    if full_text is not None and texts:
        as_deltas = "".join(texts) == full_text
        as_whole = growing and texts[-1] == full_text
        if as_deltas != as_whole:
            return as_whole
    if len(set(texts)) > 1:
        return growing
    return default

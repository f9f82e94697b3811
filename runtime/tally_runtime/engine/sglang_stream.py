"""PURE: SGLang stream items -> normalized deltas (SGLANG_CONTRACT.md §8), for either streaming mode.

Text and ids are handled independently, because generations A/B stream cumulative text even when ids
are deltas. Ids are clamped by the engine's cumulative `completion_tokens`, which also drops the
duplicated last id of an abort-in-waiting-queue item. If items arrive cumulative while we were told
they are incremental (the bug that duplicated text and inflated usage elsewhere), the stream fails
loudly instead of relaying it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tally_runtime.engine.base import Delta, EngineError, FinishReason, TokenLogprob


@dataclass(frozen=True, slots=True)
class StreamShape:
    """What SGLang sends in this process: per field, cumulative (whole output so far) or delta."""

    ids_cumulative: bool
    text_cumulative: bool
    logprobs_cumulative: bool = False  # output logprob lists; 0.5.10 sent them cumulatively in incremental mode
    drops_backlog_ids: bool = False  # <= 0.5.9: a coalesced item carries only the newest ids (§3)

    @property
    def incremental(self) -> bool:
        return not (self.ids_cumulative or self.text_cumulative)


_NO_META: Mapping[str, Any] = MappingProxyType({})


class StreamModeViolation(EngineError):
    """SGLang sent cumulative output where the adapter was told to expect deltas."""


@dataclass(slots=True)
class ChoiceStream:
    shape: StreamShape
    piece: Callable[[int], str]  # token id -> text, for logprob entries SGLang leaves without text
    want_logprobs: bool = False
    ids_emitted: int = 0
    ids_dropped: int = 0  # ids SGLang counted but never sent (drops_backlog_ids)
    text_emitted: int = 0  # characters, for cumulative text
    logprobs_emitted: int = 0  # entries, for cumulative logprob lists
    plain: bool = field(init=False)  # deltas of ids and text, no logprobs, no dropped backlog: the common case

    def __post_init__(self) -> None:
        shape = self.shape
        self.plain = shape.incremental and not shape.drops_backlog_ids and not self.want_logprobs

    def convert(self, item: Mapping[str, Any]) -> Delta:
        # Runs once per stream item (per token when the reader keeps up). An unfinished item of a plain
        # stream, with every field there and ids that fit the engine's count, is taken as it is: one pass,
        # no copies (benchmarks/README.md, relay through the adapter). Everything else, a missing or odd
        # field included, goes the general way, which checks and slices; both give the same delta.
        if self.plain:
            try:
                meta = item["meta_info"]
                if meta["finish_reason"] is None:
                    ids = tuple(item["output_ids"])
                    completion = meta["completion_tokens"]
                    emitted = self.ids_emitted + len(ids)
                    if emitted <= completion:
                        delta = Delta(item["text"] or "", ids, None, meta["prompt_tokens"], completion,
                                      meta.get("cached_tokens"), meta.get("reasoning_tokens") or None)
                        self.ids_emitted = emitted  # last: a missing field above leaves nothing changed
                        return delta
            except (KeyError, TypeError):
                pass
        return self.convert_general(item)

    def convert_general(self, item: Mapping[str, Any]) -> Delta:
        """Any item of any shape (what `convert` does when its plain case does not apply)."""
        meta: Mapping[str, Any] = item.get("meta_info") or _NO_META
        finish = meta.get("finish_reason")
        completion = meta.get("completion_tokens")
        waiting_abort = finish is not None and _is_waiting_queue_abort(finish, meta)
        ids = self._delta_ids(item.get("output_ids") or (), completion, waiting_abort)
        text = item.get("text") or ""
        if self.shape.text_cumulative or waiting_abort:
            text = self._delta_text(text, waiting_abort)
        logprobs = self._delta_logprobs(meta) if self.want_logprobs else None
        dropped = 0
        if self.shape.drops_backlog_ids and completion is not None and not waiting_abort:
            dropped = max(0, completion - self.ids_dropped - self.ids_emitted - len(ids))
            self.ids_dropped += dropped
        self.ids_emitted += len(ids)
        try:
            reason = finish_reason(finish) if finish else None
        except EngineError as err:  # an abort with a status: its counts are still the engine's word
            err.final = Delta(text, ids, logprobs, meta.get("prompt_tokens"), completion, meta.get("cached_tokens"),
                              meta.get("reasoning_tokens") or None, FinishReason.ABORT, dropped)
            raise
        return Delta(text, ids, logprobs, meta.get("prompt_tokens"), completion, meta.get("cached_tokens"),
                     meta.get("reasoning_tokens") or None, reason, dropped)

    def _delta_ids(self, raw: Sequence[int], completion: int | None, waiting_abort: bool) -> tuple[int, ...]:
        ids = raw[self.ids_emitted:] if self.shape.ids_cumulative else raw
        if completion is None:
            return tuple(ids)
        room = max(0, completion - self.ids_emitted - self.ids_dropped)
        if len(ids) <= room:
            return tuple(ids)
        if not self.shape.ids_cumulative and not waiting_abort:
            raise StreamModeViolation(
                f"SGLang sent {len(ids)} token ids where {room} were new: it is streaming cumulatively "
                "although incremental streaming was verified; refusing to relay duplicated output"
            )
        return tuple(ids[:room])

    def _delta_text(self, text: str, waiting_abort: bool) -> str:
        if self.shape.text_cumulative:
            delta = text[self.text_emitted:]
            self.text_emitted = max(self.text_emitted, len(text))
            return delta
        # An abort-in-waiting-queue item carries the full accumulated text even in incremental mode.
        return "" if waiting_abort else text

    def _delta_logprobs(self, meta: Mapping[str, Any]) -> tuple[TokenLogprob, ...]:
        tokens: Sequence[Any] = meta.get("output_token_logprobs") or ()
        tops: Sequence[Any] = meta.get("output_top_logprobs") or ()
        if self.shape.logprobs_cumulative:
            tokens, tops = tokens[self.logprobs_emitted:], tops[self.logprobs_emitted:]
        self.logprobs_emitted += len(tokens)
        out = []
        for i, (logprob, token_id, text) in enumerate(tokens):
            alternatives = tops[i] if i < len(tops) and tops[i] else ()
            out.append(TokenLogprob(
                token=text if text is not None else self.piece(token_id),
                logprob=_finite(logprob),
                top=tuple((t if t is not None else self.piece(tid), _finite(lp)) for lp, tid, t in alternatives),
            ))
        return tuple(out)


def finish_reason(finish: Mapping[str, Any] | None) -> FinishReason | None:
    """Map SGLang's finish dict; an abort that carries an HTTP status is the request's error."""
    if not finish:
        return None
    kind = finish.get("type")
    if kind == "stop":
        return FinishReason.STOP
    if kind == "length":
        return FinishReason.LENGTH
    status = finish.get("status_code")
    if status is not None:
        raise EngineError(str(finish.get("message") or "SGLang aborted the request"), int(status))
    return FinishReason.ABORT


def _is_waiting_queue_abort(finish: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
    """`_handle_abort_req` items lack prompt counts (SGLANG_CONTRACT.md §2.5)."""
    return finish.get("type") == "abort" and "prompt_tokens" not in meta


def _finite(value: float | None) -> float:
    if value is None:
        return -9999.0
    return max(float(value), -9999.0)

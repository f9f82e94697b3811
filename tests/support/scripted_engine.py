"""A scripted engine for the serving core's tests: it decides only *when* deltas arrive (a whole backlog at
once, a choice stuck in prefill, a refusal before the first token) and how an abort ends a choice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tally_runtime.engine.base import (
    CacheLoad,
    Delta,
    EngineInfo,
    EngineMetrics,
    FinishReason,
    GenerationRequest,
    Health,
)

INFO = EngineInfo(model_path="/m", context_length=512, vocab_size=100)


class Script:
    """Per choice index (the request id's middle part): deltas, then optionally an error or a stall."""

    def __init__(self, deltas: dict[int, list[Delta]], error: dict[int, Exception] | None = None,
                 stall: set[int] | None = None, gate: asyncio.Event | None = None, paced: bool = False) -> None:
        self.deltas = deltas
        self.error = error or {}
        self.stall = stall or set()
        self.gate = gate
        self.paced = paced  # hand control back after every delta, as a real engine between steps


class ScriptedEngine:
    """Aborting a choice ends it at its next step: with an ABORT delta counting one more token than it sent
    (as SGLang counts one past the last item read), or with no counts at all while still in prefill."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.aborts: dict[int, asyncio.Event] = {}

    def abort(self, request_id: str) -> None:
        self.aborts.setdefault(int(request_id.split(".")[1]), asyncio.Event()).set()

    async def start(self) -> EngineInfo:
        return INFO

    async def stop(self) -> None:
        pass

    def health(self) -> Health:
        return Health(True)

    def own_metrics(self) -> EngineMetrics:
        return EngineMetrics()

    def cache_load(self) -> CacheLoad:
        return CacheLoad()

    def tokenize(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        return [1] * len(text.split()) + ([0] if add_special_tokens else [])

    def detokenize(self, ids: Sequence[int]) -> str:
        return " w" * len(ids)

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        return " ".join(m["content"] for m in messages)

    def tool_parser(self, tools: list[dict[str, Any]]) -> None:
        """No parser of a model family's calls."""

    async def check_json_schema(self, schema: str) -> None:
        """Any schema is accepted: this engine generates what its script says."""

    def control_tokens(self) -> frozenset[str]:
        return frozenset()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        index = int(request.request_id.split(".")[1])
        aborted = self.aborts.setdefault(index, asyncio.Event())
        if self.script.gate is not None:
            await self.script.gate.wait()
        if index in self.script.stall:
            await aborted.wait()  # still in prefill until aborted
            yield Delta(finish_reason=FinishReason.ABORT)
            return
        sent = 0
        for delta in self.script.deltas.get(index, []):
            if aborted.is_set():
                yield Delta(token_ids=(99,), prompt_tokens=delta.prompt_tokens, completion_tokens=sent + 1,
                            finish_reason=FinishReason.ABORT)
                return
            yield delta
            sent = delta.completion_tokens or sent
            if self.script.paced:
                await asyncio.sleep(0)
        if index in self.script.error:
            raise self.script.error[index]


def tokens(count: int, prompt: int = 3, start: int = 0, finish: bool = True) -> list[Delta]:
    return [Delta(text=f" t{i}", token_ids=(i,), prompt_tokens=prompt, completion_tokens=i + 1,
                  finish_reason=FinishReason.LENGTH if finish and i == count - 1 else None)
            for i in range(start, count)]

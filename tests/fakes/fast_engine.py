"""A token source with no model, behind the real Engine port: the CPU-free path for the relay benchmark and
the runtime's stress tests. One token per delta with engine-style cumulative counts; an abort lands at the
next step, whose token is in the final ABORT delta, as SGLang's does (SGLANG_CONTRACT.md §2.5)."""

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


class FastEngine:
    def __init__(self, seconds_per_token: float = 0.0) -> None:
        self.seconds_per_token = seconds_per_token  # 0: as fast as it can, handing control back now and then
        self.aborted: set[str] = set()
        self.running: set[str] = set()

    async def start(self) -> EngineInfo:
        return EngineInfo(model_path="none", context_length=1 << 20, vocab_size=1000, engine_kind="fast")

    async def stop(self) -> None:
        return None

    def health(self) -> Health:
        return Health(True)

    def own_metrics(self) -> EngineMetrics:
        return EngineMetrics()

    def cache_load(self) -> CacheLoad:
        return CacheLoad()

    def tokenize(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        return [1] * max(1, len(text.split()))

    def detokenize(self, ids: Sequence[int]) -> str:
        return " tok" * len(ids)

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        return " ".join(m["content"] for m in messages)

    def tool_parser(self, tools: list[dict[str, Any]]) -> None:
        """No parser of a model family's calls."""

    async def check_json_schema(self, schema: str) -> None:
        """Any schema is accepted: this engine generates what its script says."""

    def control_tokens(self) -> frozenset[str]:
        return frozenset()

    def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.aborted.add(request_id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        n, prompt, rid = request.sampling.max_tokens, len(request.prompt_ids), request.request_id
        self.running.add(rid)
        try:
            for i in range(1, n + 1):
                aborted = rid in self.aborted
                finish = FinishReason.ABORT if aborted else FinishReason.LENGTH if i == n else None
                yield Delta(text=" tok", token_ids=(7,), prompt_tokens=prompt, completion_tokens=i,
                            finish_reason=finish)
                if aborted:
                    return
                if self.seconds_per_token:
                    await asyncio.sleep(self.seconds_per_token)
                elif i % 16 == 0:
                    await asyncio.sleep(0)  # an engine hands control back now and then
        finally:
            self.running.discard(rid)
            self.aborted.discard(rid)

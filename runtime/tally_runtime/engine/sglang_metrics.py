"""SGLang's own series, as an embedding server has to collect them (SGLANG_CONTRACT.md §7, §10).

Its scheduler and detokenizer write them to PROMETHEUS_MULTIPROC_DIR; its tokenizer manager lives in
this process, and since prometheus_client was imported before SGLang set that variable, those counters
are in this process's default registry. Both are served, and SGLang's token counters are summed for the
drift against the usage Tally counted.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, generate_latest

from tally_runtime import contract
from tally_runtime.engine.base import EngineMetrics


def sglang_metrics() -> EngineMetrics:
    text = sglang_series()
    totals = engine_totals(text.decode())
    return EngineMetrics(text, totals.get(contract.SGLANG_PROMPT_TOKENS), totals.get(contract.SGLANG_GENERATION_TOKENS))


def engine_totals(text: str) -> dict[str, float]:
    """Sum SGLang's token counters over all their label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (contract.SGLANG_PROMPT_TOKENS, contract.SGLANG_GENERATION_TOKENS):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def engine_gauges(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Gauges of SGLang's own series: summed over label sets (one per data-parallel rank) for a queue, the
    largest for a fraction (each rank's cache is its own)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                values.setdefault(sample.name, []).append(sample.value)
    return {name: max(v) if name == contract.SGLANG_KV_CACHE_USAGE else sum(v) for name, v in values.items()}


def sglang_series() -> bytes:
    """SGLang's own series (enable_metrics), from this process's default registry and the multiprocess files."""
    from prometheus_client import REGISTRY, multiprocess

    text = _only_sglang(generate_latest(REGISTRY))
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory and os.path.isdir(directory):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
        text += _only_sglang(generate_latest(registry))  # ours are served from our own registry
    return text


def _only_sglang(text: bytes) -> bytes:
    keep = [line for line in text.splitlines(keepends=True)
            if line.startswith(b"sglang:") or line.startswith((b"# HELP sglang:", b"# TYPE sglang:"))]
    return b"".join(keep)

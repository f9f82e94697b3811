"""PURE: the model-server protocol's gauges (Gateway API Inference Extension, proposal 003), as the endpoint
picker reads them from an SGLang pod (its `sglang` engine config): served on the API port's `/metrics`
with `--model-server-metrics`, and nothing else there (a tenant's usage stays on the metrics port).

- `sglang:num_queue_reqs`: requests waiting in Tally's admission queue plus those in the engine's own queue.
  The picker chooses by it: without Tally's queue a pod full of waiting requests would look idle.
- `sglang:num_running_reqs`: generations running in the engine.
- `sglang:token_usage`: the fraction of the KV cache in use (0 to 1), the engine's own figure.
- `sglang:cache_config_info{page_size, num_pages}` = 1: the KV cache's shape (the picker's prefix scorer).
"""

from __future__ import annotations

import math

from tally_runtime.engine.base import CacheLoad

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return repr(float(value)) if math.isfinite(value) else "0.0"


def render(model: str, admission_queued: int, running: int, load: CacheLoad) -> bytes:
    labels = f'model_name="{_label(model)}"'
    gauges = (
        ("sglang:num_queue_reqs", "Requests waiting: Tally's admission queue and the engine's own",
         admission_queued + max(0.0, load.queued)),
        ("sglang:num_running_reqs", "Generations running in the engine", float(running)),
        ("sglang:token_usage", "Fraction of the KV cache in use", min(1.0, max(0.0, load.kv_usage))),
    )
    lines: list[str] = []
    for name, help_text, value in gauges:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {_number(value)}"]
    lines += ["# HELP sglang:cache_config_info The KV cache's shape: tokens per page and pages",
              "# TYPE sglang:cache_config_info gauge",
              f'sglang:cache_config_info{{{labels},page_size="{max(1, load.page_size)}",'
              f'num_pages="{max(0, load.num_pages)}"}} 1.0']
    return ("\n".join(lines) + "\n").encode()

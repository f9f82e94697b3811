"""Run the SGLang adapter on the real engine twice: consumed at full speed, and by a slow consumer.

    slow_consumer.py MODEL_DIR "ENGINE ARGS" OUT.json     (writes the deltas' ids and texts per run)
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from tally_runtime.engine.base import GenerationRequest, SamplingParams
from tally_runtime.engine.sglang import SGLangEngine
from tally_runtime.settings import Settings


async def run(model: str, engine_args: str) -> dict[str, Any]:
    settings = Settings(engine="sglang", model_path=model, engine_args=tuple(json.loads(engine_args)))
    engine = SGLangEngine(settings.engine_config())
    await engine.start()
    try:
        ids = engine.tokenize("Count from one to fifty:")
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        result: dict[str, Any] = {}
        for name, pause in (("fast", 0.0), ("slow", 4.0)):
            deltas = []
            async for delta in engine.generate(GenerationRequest(f"{name}.", ids, params)):
                deltas.append(delta)
                if len(deltas) == 2:
                    await asyncio.sleep(pause)  # the consumer falls behind once: SGLang builds a backlog
            result[name] = {"ids": [list(d.token_ids) for d in deltas], "text": [d.text for d in deltas],
                            "completion_tokens": deltas[-1].completion_tokens}
        return result
    finally:
        await engine.stop()


if __name__ == "__main__":
    Path(sys.argv[3]).write_text(json.dumps(asyncio.run(run(sys.argv[1], sys.argv[2]))))

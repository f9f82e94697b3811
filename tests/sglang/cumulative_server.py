"""A runtime whose SGLang has incremental streaming switched off (test-only; the product always asks for it).

This is what an attribute assignment that SGLang silently ignored amounted to: the engine streams
cumulatively while the adapter asked for deltas. The adapter must notice and keep /health at 503.
"""

from __future__ import annotations

import sys
from typing import Any

import uvicorn

from tally_runtime.app import create_app
from tally_runtime.engine import sglang_compat
from tally_runtime.engine.sglang import SGLangEngine
from tally_runtime.settings import settings_from


def switched_off(server_args_cls: type, base: Any, incremental: bool = True) -> dict[str, Any]:
    return {**base, sglang_compat.streaming_field(server_args_cls): False}


def main() -> None:
    settings = settings_from(sys.argv[1:], {})
    sglang_compat.engine_kwargs = switched_off  # type: ignore[assignment]
    app = create_app(settings, SGLangEngine(settings.engine_config()))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()

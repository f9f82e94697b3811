"""A test-only stand-in for `sglang` that reproduces SGLANG_CONTRACT.md, driven by the real CPU model.

Never installed; tests put `tests/fakes` first on sys.path. `configure(version=..., coalesce=...)` picks the
generation (A: 0.5.5, B: 0.5.9, C: 0.5.16, D: 0.5.23) and the backlog pattern the consumer sees.
"""

from typing import Any

from sglang._fake import Engine, FakeConfig, configure, current

__all__ = ["Engine", "FakeConfig", "configure", "current"]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        return current().version
    raise AttributeError(name)

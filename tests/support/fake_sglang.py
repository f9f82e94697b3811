"""Put the contract fake of `sglang` (tests/fakes/sglang) on the import path."""

from __future__ import annotations

import sys
from pathlib import Path

FAKES = str(Path(__file__).resolve().parents[1] / "fakes")
if FAKES not in sys.path:
    sys.path.insert(0, FAKES)

import sglang  # noqa: E402

assert "fakes" in (sglang.__file__ or ""), "a real sglang shadows the contract fake"

GENERATIONS = {"A": "0.5.5", "B": "0.5.9", "C": "0.5.16", "D": "0.5.23"}

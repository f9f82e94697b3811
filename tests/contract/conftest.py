"""Contract tests import `sglang` from the test-only fake (tests/fakes); the real one lives in its own venv."""

from __future__ import annotations

import sys
from pathlib import Path

FAKES = str(Path(__file__).resolve().parents[1] / "fakes")
if FAKES not in sys.path:
    sys.path.insert(0, FAKES)

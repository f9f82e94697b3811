"""Contract tests import `sglang` from the test-only fake (tests/fakes); the real one lives in its own venv.
The record delivery tests share a receiver (records_harness.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from records_harness import Receiver, receiving

FAKES = str(Path(__file__).resolve().parents[1] / "fakes")
if FAKES not in sys.path:
    sys.path.insert(0, FAKES)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A billing system's ingest endpoint (records_harness.py), stopped afterwards."""
    yield from receiving()

"""The chart ships the canonical CRD, byte for byte (Helm installs it; nothing else may differ)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "tally-operator"


def test_chart_crd_is_the_canonical_crd() -> None:
    canonical = ROOT / "crds" / "serving.tally.dev_completionservices.yaml"
    assert (CHART / "crds" / canonical.name).read_bytes() == canonical.read_bytes()

"""The chart ships the canonical CRD, byte for byte (Helm installs it; nothing else may differ)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "tally-operator"


def test_chart_crd_is_the_canonical_crd() -> None:
    canonical = ROOT / "crds" / "serving.tally.dev_completionservices.yaml"
    assert (CHART / "crds" / canonical.name).read_bytes() == canonical.read_bytes()


def test_values_docs_schema_and_readme_are_generated_from_the_values_comments() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "hack" / "chart_docs.py"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["watchNamespaces"]["description"].startswith("Namespaces to watch")
    assert schema["properties"]["metrics"]["properties"]["port"]["default"] == 9090


"""`helm upgrade` upgrades the CompletionService CRD with the operator: from the previous chart's layout (the CRD
in crds/, applied outside the release, which Helm never upgrades) and from one release to the next, with no
kubectl step. The session's release is moved to the older chart and back."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from kube_harness import Kubectl
from operator_harness import CHART, OPERATOR_REPLICAS, SUITE_SETTINGS, ChartOperator, install_chart

CRD = "completionservices.serving.tally.dev"
FILE = "serving.tally.dev_completionservices.yaml"


def columns(kubectl: Kubectl) -> list[str]:
    crd = kubectl.json("get", "crd", CRD)
    return [c["name"] for c in crd["spec"]["versions"][0].get("additionalPrinterColumns", [])]


def older_chart(tmp: Path, in_crds_folder: bool) -> Path:
    """This chart as it was before the `Desired` column: its CRD in crds/ (chart 0.1) or as a template."""
    chart = tmp / "tally-operator"
    shutil.copytree(CHART, chart)
    crd = yaml.safe_load((chart / "files" / "crds" / FILE).read_text())
    version = crd["spec"]["versions"][0]
    version["additionalPrinterColumns"] = [c for c in version["additionalPrinterColumns"] if c["name"] != "Desired"]
    (chart / "files" / "crds" / FILE).write_text(yaml.safe_dump(crd, sort_keys=False))
    if in_crds_folder:
        (chart / "files" / "crds" / FILE).rename(chart / "crds" / FILE)
    return chart


def test_helm_upgrade_brings_the_crd_along_from_the_previous_layout_and_between_releases(
        operator: ChartOperator, kubectl: Kubectl, tmp_path: Path) -> None:
    assert "Desired" in columns(kubectl)
    try:
        # Chart 0.1's CRD: applied by kubectl (as its crds/ folder was), outside the release and without Desired
        old = older_chart(tmp_path / "a", in_crds_folder=True)
        kubectl("annotate", "crd", CRD, "meta.helm.sh/release-name-", "meta.helm.sh/release-namespace-")
        kubectl("label", "crd", CRD, "app.kubernetes.io/managed-by-")
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(old / "crds" / FILE))
        assert "Desired" not in columns(kubectl)
        install_chart(kubectl, OPERATOR_REPLICAS, *SUITE_SETTINGS)  # the README's one upgrade: --take-ownership
        assert "Desired" in columns(kubectl)
        crd = kubectl.json("get", "crd", CRD)["metadata"]
        assert crd["annotations"]["helm.sh/resource-policy"] == "keep"
        assert crd["annotations"]["meta.helm.sh/release-name"] == "tally-operator"

        # Release to release: a column dropped and added back by plain upgrades
        install_chart(kubectl, OPERATOR_REPLICAS, *SUITE_SETTINGS, chart=older_chart(tmp_path / "b", False))
        assert "Desired" not in columns(kubectl)
    finally:
        install_chart(kubectl, OPERATOR_REPLICAS, *SUITE_SETTINGS)
    assert "Desired" in columns(kubectl)
    operator.ready()

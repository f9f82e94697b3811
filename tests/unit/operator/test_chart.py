"""The chart ships the canonical CRD, byte for byte (Helm installs it; nothing else may differ)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "tally-operator"


def test_chart_crds_are_the_canonical_crds() -> None:
    canonical = sorted((ROOT / "crds").glob("serving.tally.dev_*.yaml"))
    assert [p.name for p in canonical] == ["serving.tally.dev_budgets.yaml", "serving.tally.dev_budgetshards.yaml",
                                           "serving.tally.dev_completionservices.yaml",
                                           "serving.tally.dev_usageshards.yaml"]
    assert sorted(p.name for p in (CHART / "files" / "crds").glob("*.yaml")) == [p.name for p in canonical]
    for path in canonical:
        assert (CHART / "files" / "crds" / path.name).read_bytes() == path.read_bytes()


def test_the_readmes_registry_commands_name_the_charts_own_version() -> None:
    """`helm package` names the archive by the chart's version (not the images' appVersion)."""
    import re

    import yaml

    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    readme = (ROOT / "README.md").read_text()
    assert set(re.findall(r"tally-operator-([0-9][^ ]*)\.tgz", readme)) == {version}
    assert set(re.findall(r"charts/tally-operator --version ([^ ]+)", readme)) == {version}


def test_values_docs_schema_and_readme_are_generated_from_the_values_comments() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "hack" / "chart_docs.py"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["watchNamespaces"]["description"].startswith("Namespaces to watch")
    assert schema["properties"]["metrics"]["properties"]["port"]["default"] == 9090



def test_the_crd_parses_and_holds_the_rules_a_service_author_cannot_bypass() -> None:
    import yaml

    crd = yaml.safe_load((ROOT / "crds" / "serving.tally.dev_completionservices.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    env = spec["engine"]["properties"]["env"]
    rules = " ".join(rule["rule"] for rule in env["x-kubernetes-validations"])
    assert "valueFrom" in rules and "TALLY_" in rules and env["maxItems"] == 64
    assert spec["auth"]["properties"]["apiKeysSecret"]["required"] == ["name"]


def test_the_crd_and_the_admission_policy_allow_the_engine_args_the_contract_allows() -> None:
    """One allow-list, three places that enforce it: contract.py (operator, runtime), the CRD, the policy."""
    import yaml

    from tally_runtime.contract import engine_args_pattern

    crd = yaml.safe_load((ROOT / "crds" / "serving.tally.dev_completionservices.yaml").read_text())
    args = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"][
        "properties"]["args"]
    assert [r["rule"] for r in args["x-kubernetes-validations"]] == [
        f"self.all(a, a.matches('{engine_args_pattern()}'))"]
    assert args["maxItems"] == 64
    policy = (CHART / "templates" / "admission-policy.yaml").read_text()
    assert f"object.spec.engine.args.all(a, a.matches('{engine_args_pattern()}'))" in policy


def test_every_property_of_the_crd_declares_its_type() -> None:
    """A description with a comma in a YAML flow map silently becomes another property: catch it here."""
    import yaml

    crd = yaml.safe_load((ROOT / "crds" / "serving.tally.dev_completionservices.yaml").read_text())
    untyped: list[str] = []

    def walk(node: dict[str, object], path: str) -> None:
        for name, child in (node.get("properties") or {}).items():  # type: ignore[attr-defined]
            if not isinstance(child, dict) or not ({"type", "x-kubernetes-preserve-unknown-fields"} & set(child)):
                untyped.append(f"{path}.{name}")
            elif isinstance(child, dict):
                walk(child, f"{path}.{name}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], f"{path}[]")  # type: ignore[arg-type]

    walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")
    assert untyped == []


def test_every_named_crd_field_is_described() -> None:
    """`kubectl explain completionservice.<field>` has something to say for every field a user sees."""
    import yaml

    crd = yaml.safe_load((ROOT / "crds" / "serving.tally.dev_completionservices.yaml").read_text())
    missing: list[str] = []

    def walk(node: object, path: str) -> None:
        if not isinstance(node, dict):
            return
        if path and "description" not in node and not path.endswith((".metadata", "[]", "{}")):
            missing.append(path)
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}")
        walk(node.get("items"), f"{path}[]")
        walk(node.get("additionalProperties"), f"{path}{{}}")

    walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")
    assert not missing


def test_every_dashboard_panel_says_what_it_shows_and_names_its_series() -> None:
    dashboard = json.loads((CHART / "monitoring" / "dashboard.json").read_text())
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "namespace", "service"}
    # a query variable lists what exists when the time range moves (without `refresh`, only what it found once)
    assert all(v.get("refresh") == 2 for v in dashboard["templating"]["list"] if v["type"] == "query")
    for panel in dashboard["panels"]:
        assert panel.get("description"), panel["title"]
        for target in panel["targets"]:
            assert target.get("legendFormat") and "$service" in target["expr"], (panel["title"], target["expr"])


def test_every_property_of_every_crd_is_a_schema() -> None:
    """A comma in a flow mapping's description makes a stray key (`{type: integer, description: a, b}`), which
    YAML reads fine and the API server refuses: every property must map to a schema with a type or preserved
    fields."""
    def walk(schema: Any, where: str) -> None:
        assert isinstance(schema, dict), where
        assert "type" in schema or schema.get("x-kubernetes-preserve-unknown-fields") or "anyOf" in schema, where
        assert all(key in KNOWN for key in schema), (where, [k for k in schema if k not in KNOWN])
        for name, sub in (schema.get("properties") or {}).items():
            walk(sub, f"{where}.{name}")
        if isinstance(schema.get("items"), dict):
            walk(schema["items"], f"{where}[]")
        if isinstance(schema.get("additionalProperties"), dict):
            walk(schema["additionalProperties"], f"{where}{{}}")

    for path in sorted((ROOT / "crds").glob("serving.tally.dev_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            walk(version["schema"]["openAPIV3Schema"], f"{path.name}:{version['name']}")


KNOWN = {"type", "description", "properties", "items", "additionalProperties", "required", "enum", "default",
         "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "maxProperties", "minProperties",
         "pattern", "format", "nullable", "anyOf", "oneOf", "x-kubernetes-validations", "x-kubernetes-list-type",
         "x-kubernetes-list-map-keys", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string",
         "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "x-kubernetes-map-type"}


def test_a_ca_bundle_that_is_not_pem_is_refused_by_the_values_schema() -> None:
    """A `usageRecords.caBundle` that is not PEM was taken by the chart and kept the operator from starting (no
    service booked). The values schema refuses it; PEM certificates, and nothing, pass."""
    pattern = re.compile(json.loads((CHART / "values.schema.json").read_text())["properties"]["usageRecords"][
        "properties"]["caBundle"]["pattern"])
    pem = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUQ+ab=\n-----END CERTIFICATE-----\n"
    assert pattern.search("") and pattern.search(pem) and pattern.search(pem + pem)
    for bad in ("not a pem", "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----", pem + "tail"):
        assert not pattern.search(bad), bad


def test_every_field_of_every_crd_says_what_it_is() -> None:
    """`kubectl explain budget.spec` showed `<empty>` (issue 63, item 4): every property of the four CRDs has a
    description (object metadata is Kubernetes' own)."""
    missing = []

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        for name, sub in (node.get("properties") or {}).items():
            where = f"{path}.{name}"
            if where.count(".") > 1 or name != "metadata":
                if not (isinstance(sub, dict) and sub.get("description")):
                    missing.append(where)
                walk(sub, where)
        for key in ("items", "additionalProperties"):
            walk(node.get(key), f"{path}[]")

    for path in sorted((ROOT / "crds").glob("serving.tally.dev_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            walk(version["schema"]["openAPIV3Schema"], crd["spec"]["names"]["kind"])
    assert not missing, missing

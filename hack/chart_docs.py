#!/usr/bin/env python3
"""The chart's values documented once: `# -- ` comments in values.yaml are the source of every description.

Writes the descriptions and defaults into values.schema.json (which keeps its hand-written types) and the
values table of the chart's README (between the `values:start`/`values:end` markers). `--check` changes
nothing and fails when either is out of date (a unit test runs it).

    python hack/chart_docs.py [--check]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "tally-operator"
START, END = "<!-- values:start -->", "<!-- values:end -->"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z][A-Za-z0-9]*):")


def documented(values_text: str) -> list[tuple[str, str]]:
    """(dotted key, description) in file order, for every key preceded by a `# -- ` comment."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in values_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# -- "):
            pending = [stripped[5:]]
            continue
        if stripped.startswith("#") and pending:
            pending.append(stripped.lstrip("# "))
            continue
        match = KEY.match(line)
        if not match:
            pending = [] if not stripped else pending
            continue
        indent = len(match["indent"])
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, match["key"])]
        if pending:
            out.append((".".join(k for _, k in stack), " ".join(pending)))
        pending = []
    return out


def lookup(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def schema_node(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    node = schema
    for part in dotted.split("."):
        node = node["properties"][part]
    return node


def render_default(value: Any) -> str:
    return f"`{json.dumps(value)}`" if value not in ("", None) else "`\"\"`"


def generate(values_text: str, schema: dict[str, Any], readme: str) -> tuple[dict[str, Any], str]:
    values = yaml.safe_load(values_text)
    rows = ["| key | default | description |", "|---|---|---|"]
    for dotted, description in documented(values_text):
        default = lookup(values, dotted)
        node = schema_node(schema, dotted)
        node["description"] = description
        node["default"] = default
        rows.append(f"| `{dotted}` | {render_default(default)} | {description} |")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return schema, f"{head}{START}\n" + "\n".join(rows) + f"\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the schema or README is out of date")
    args = parser.parse_args()
    schema_path, readme_path = CHART / "values.schema.json", CHART / "README.md"
    schema, readme = generate((CHART / "values.yaml").read_text(), json.loads(schema_path.read_text()),
                              readme_path.read_text())
    schema_text = json.dumps(schema, indent=2) + "\n"
    stale = [p.name for p, text in ((schema_path, schema_text), (readme_path, readme)) if p.read_text() != text]
    if args.check:
        if stale:
            print(f"out of date: {', '.join(stale)}; run python hack/chart_docs.py", file=sys.stderr)
        return 1 if stale else 0
    schema_path.write_text(schema_text)
    readme_path.write_text(readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The operator depends on the runtime only through `tally_runtime.contract` and `tally_runtime.units` (names,
shapes and a budget's unit, both sides' alike; standard library only), never on an engine or a server."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ("tally_runtime.engine", "tally_runtime.serving", "tally_runtime.app", "fastapi", "uvicorn",
           "llama_cpp", "sglang", "torch")
RUNTIME_ONLY = ("orjson", "msgspec")  # the runtime's dependencies, not in the operator's image (probing is fine)


SCRIPT = textwrap.dedent(f"""
    import importlib.abc, sys

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in {BLOCKED!r}):
                raise ImportError(f"the operator must not import {{name}}")
            return None

    sys.meta_path.insert(0, Blocker())
    import tally_operator.__main__, tally_operator.handlers  # every module of the operator, through its entry
    loaded = sorted(m for m in sys.modules if m.startswith("tally_runtime"))
    assert loaded == ["tally_runtime", "tally_runtime.contract", "tally_runtime.units"], loaded
    imported = [m for m in {RUNTIME_ONLY!r} if m in sys.modules]
    assert not imported, f"not in the operator's image: {{imported}}"
    print("ok")
""")


def test_the_operator_imports_only_the_contract_and_the_units_of_the_runtime() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_the_operators_modules_import_each_other_one_way_only() -> None:
    """No import circle (there was one: budget -> usage -> status -> spec -> budget, held apart only by an import
    under TYPE_CHECKING): each module's imports of the package, typing-only ones included, form no cycle."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[3] / "operator" / "tally_operator"
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        edges = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tally_operator"):
                target = node.module.removeprefix("tally_operator").lstrip(".")
                if target:
                    edges.add(target)
                else:  # `from tally_operator import constants as c`
                    edges.update(alias.name for alias in node.names)
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for target in sorted(graph.get(module, ())):
            assert seen.get(target) != 1, " -> ".join([*path, module, target])
            if target not in seen:
                visit(target, [*path, module])
        seen[module] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [])


IO_MODULES = {"kube", "books", "shard_store", "budget_round", "budget_shard_store", "scrape", "collector", "reconcile",
              "handlers", "children", "scaling", "release", "activation", "asks"}


def test_a_module_that_says_it_is_pure_does_no_io() -> None:
    """The money code reads as rooms: a module whose docstring opens with PURE imports no I/O (the API client,
    kopf, an event loop, an HTTP client or a module that does I/O), and each of the books' and the budgets'
    modules says which it is."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[3] / "operator" / "tally_operator"
    money = {"usage", "shards", "tenant_books", "bookkeeping", "budget", "slices", "platform", "budget_shards",
             "books", "shard_store", "budget_round", "budget_shard_store"}
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree) or ""
        if path.stem in money:
            assert doc.startswith(("PURE:", "I/O:")), f"{path.stem}: say PURE or I/O first"
        if not doc.startswith("PURE:"):
            continue
        for node in ast.walk(tree):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                inner = name.removeprefix("tally_operator.").removeprefix("tally_operator")
                assert name.split(".")[0] not in {"kopf", "kubernetes", "httpx", "asyncio"} and \
                    inner not in IO_MODULES, f"{path.stem} says it is pure and imports {name}"

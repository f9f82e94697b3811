"""The operator depends on the runtime only through `tally_runtime.contract`, never on an engine or a server."""

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
    assert loaded == ["tally_runtime", "tally_runtime.contract"], loaded
    imported = [m for m in {RUNTIME_ONLY!r} if m in sys.modules]
    assert not imported, f"not in the operator's image: {{imported}}"
    print("ok")
""")


def test_the_operator_imports_only_the_contract_of_the_runtime() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]

"""What the runtime needs at import is what every runtime installs: the `runtime` extra. Optional parts
(record delivery's HTTP client, the hand-off's signature check) are imported when they are switched on, so
a runtime in another environment (SGLang's own venv) starts without them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

OPTIONAL = ("httpx", "cryptography", "kopf", "kubernetes", "tally_operator")

SCRIPT = textwrap.dedent(f"""
    import importlib.abc, sys

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in {OPTIONAL!r}):
                raise ImportError(f"the runtime must not need {{name}} to start")
            return None

    sys.meta_path.insert(0, Blocker())
    import tally_runtime.__main__, tally_runtime.app, tally_runtime.delivery, tally_runtime.budgets
    print("ok")
""")


def test_the_runtime_starts_without_its_optional_dependencies() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]

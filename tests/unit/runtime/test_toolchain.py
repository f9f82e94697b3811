"""The GPU image's toolchain check (tally_runtime/toolchain.py) finds what Triton finds, and fails without it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CHECK = ROOT / "runtime" / "tally_runtime" / "toolchain.py"


def run_check(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_this_machine_compiles_and_loads_an_extension() -> None:
    result = run_check()
    assert result.returncode == 0, result.stderr
    assert "builds and loads extensions" in result.stdout


def test_no_compiler_is_refused(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    result = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=60,
                            env={**env, "PATH": str(tmp_path)})  # no gcc, no clang
    assert result.returncode == 1
    assert "no C compiler" in result.stderr


def test_a_compiler_that_fails_is_refused() -> None:
    result = run_check(CC="/bin/false")
    assert result.returncode == 1
    assert "failed" in result.stderr


def test_every_gpu_target_ends_with_the_check_run_by_its_own_python() -> None:
    """The recipe's GPU stages: each runs the toolchain check after Tally is installed, with the venv's Python
    (the one Triton runs under), and the CPU image stays the default target (the last stage)."""
    stages = dict(re.findall(r"^FROM \S+ AS (\S+)\n(.*?)(?=^FROM |\Z)", (ROOT / "runtime" / "Dockerfile").read_text(),
                             re.S | re.M))
    for target in ("sglang", "sglang-slim"):
        body = stages[target]
        install = body.index("/opt/tally/bin/pip install")
        check = body.index("gpu-toolchain.sh /opt/tally/bin/python")
        assert install < check, target
        assert 'ENTRYPOINT ["/opt/tally/bin/tally-runtime"]' in body
    assert "gpu-toolchain.sh python3" in stages["gpu-toolchain"]
    assert list(stages)[-1] == "cpu"

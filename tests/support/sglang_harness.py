"""Helpers to run the runtime on real SGLang (CPU path) for tests/sglang."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from runtime_harness import terminate

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("TALLY_SGLANG_MODEL", Path.home() / ".cache/tally/models/smollm2-135m-instruct-hf"))
# SGLang's CPU path (SGLANG_CONTRACT.md §9); the stand-in sgl_kernel is first on the path.
ENGINE_ARGS = ("--device=cpu", "--attention-backend=torch_native", "--disable-overlap-schedule",
               "--max-total-tokens=8192", "--skip-server-warmup", "--sleep-on-idle")
ENGINE_ARG_FLAGS = [f"--engine-arg={arg}" for arg in ENGINE_ARGS]  # the runtime's flags for them, one each


def sglang_env() -> dict[str, str]:
    return {**os.environ, "SGLANG_USE_CPU_ENGINE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "sglang_stub"), os.environ.get("PYTHONPATH", "")])}


def start(command: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=sglang_env(),
                                start_new_session=True)
    return proc, ""


def stop(proc: subprocess.Popen[bytes]) -> None:
    terminate(proc, timeout=60)

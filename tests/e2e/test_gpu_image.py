"""The GPU image can run SGLang's Triton kernels: its recipe's toolchain stage, built with buildah on the local
Debian base (which, like python:3.11-slim, has no C compiler), must end with a compiler and Python headers that
build and import an extension the way Triton builds its launchers. No GPU is needed to know that."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
IMAGES = Path(os.environ.get("TALLY_CACHE", Path.home() / ".cache" / "tally")) / "images"
BUILDAH = ["buildah", "--root", str(IMAGES / "storage"), "--runroot", str(IMAGES / "run"), "--storage-driver", "vfs"]


def buildah(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BUILDAH, *args], capture_output=True, text=True, timeout=timeout)


def test_the_gpu_toolchain_stage_builds_and_loads_an_extension() -> None:
    base = "localhost/tally-base:bookworm"  # made by hack/images.sh
    if buildah("inspect", "--type", "image", base, timeout=60).returncode:
        subprocess.run([str(ROOT / "hack" / "images.sh"), "--base"], check=True, timeout=900)
    # --layers: an unchanged recipe is answered from buildah's cache, so only a change costs the apt install
    built = buildah("bud", "--isolation", "chroot", "--layers", "--target", "gpu-toolchain",
                    "--build-arg", f"BASE={base}", "-t", "localhost/tally-gpu-toolchain:test",
                    "-f", str(ROOT / "runtime" / "Dockerfile"), str(ROOT))
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    # and in the image as built (a cached build prints nothing of its steps): the check, run again there
    container = buildah("from", "localhost/tally-gpu-toolchain:test", timeout=120).stdout.strip()
    try:
        ran = buildah("run", "--isolation", "chroot", container, "--", "python3",
                      "/usr/local/share/tally/toolchain.py", timeout=120)
    finally:
        buildah("rm", container, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "builds and loads extensions" in ran.stdout

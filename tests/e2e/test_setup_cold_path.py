"""The README's first command on a fresh machine: hack/build.sh and hack/images.sh as a cold `make run` runs them.

`make run` builds no Prometheus and neither the picker's image nor the tests' fakes, so on an empty cache those
components have nothing cached at all; a script under `set -euo pipefail` that lists or prunes them must not end
there (a cold `make run` once built for 37 minutes and then exited 2 in build.sh's prune). These tests run the
scripts against a scratch cache holding the real builds of everything else (hard links: nothing compiles) and
no Prometheus, picker or fakes, and require them to finish, build nothing and leave a usable `current` set.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("TALLY_CACHE", Path.home() / ".cache" / "tally"))
DEMO_IMAGES = ("pause", "runtime", "operator", "client")


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A scratch cache beside the real one (the same filesystem, so its builds can be hard-linked)."""
    path = CACHE / f".cold-path-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def link_tree(source: Path, target: Path) -> None:
    subprocess.run(["cp", "-al", str(source), str(target)], check=True)


def run(script: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / "hack" / script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TALLY_CACHE": str(cache), **env})


def test_build_sh_finishes_with_no_prometheus_ever_built(scratch: Path) -> None:
    builds = [d for d in sorted((CACHE / "bin").glob("*-v*")) if d.is_dir()]
    assert any(d.name.startswith("kube-") for d in builds), "make test builds the components first"
    (scratch / "bin").mkdir()
    for build in builds:
        if not build.name.startswith("prometheus-"):
            link_tree(build, scratch / "bin" / build.name)

    result = run("build.sh", scratch, TALLY_WITH_PROMETHEUS="0")

    assert result.returncode == 0, result.stderr
    assert "[build] built" not in result.stderr, "every component was cached: nothing may compile"
    current = scratch / "bin" / "current"
    assert result.stdout.strip() == str(current)
    for binary in ("kube-apiserver", "kubelet", "etcd", "kwok", "helm", "containerd", "coredns"):
        assert (current / binary).exists(), binary
    assert not (current / "prometheus").exists()


def test_build_sh_prunes_old_builds_but_keeps_two(scratch: Path) -> None:
    builds = [d for d in sorted((CACHE / "bin").glob("*-v*")) if d.is_dir() and not d.name.startswith("prometheus-")]
    (scratch / "bin").mkdir()
    for build in builds:
        link_tree(build, scratch / "bin" / build.name)
    stale = [scratch / "bin" / f"etcd-v0.0.{i}-old" for i in range(3)]
    for i, path in enumerate(stale):
        path.mkdir()
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # older than the real build

    result = run("build.sh", scratch, TALLY_WITH_PROMETHEUS="0")

    assert result.returncode == 0, result.stderr
    left = sorted(p.name for p in (scratch / "bin").glob("etcd-*"))
    assert len(left) == 2 and stale[-1].name in left, left  # the real build and the newest stale one


def test_images_sh_demo_set_from_cache_builds_nothing(scratch: Path) -> None:
    images = CACHE / "images"
    archives = {name: sorted(images.glob(f"{name}-*.tar"), key=lambda p: p.stat().st_mtime) for name in DEMO_IMAGES}
    assert all(archives.values()), f"make test builds the images first: {archives}"
    (scratch / "images").mkdir()
    for found in archives.values():
        for archive in found:
            os.link(archive, scratch / "images" / archive.name)
    for marker in images.glob("base-*.done"):
        os.link(marker, scratch / "images" / marker.name)

    # No Python environment and no buildah storage: only the cache may answer, no image is built
    result = run("images.sh", scratch, TALLY_IMAGE_SET="demo", PYTHON=str(scratch / "no-python"))

    assert result.returncode == 0, result.stderr
    assert not (scratch / "images" / "storage").exists(), "buildah was asked although every archive was cached"
    current = scratch / "images" / "current"
    assert result.stdout.strip() == str(current)
    for name in DEMO_IMAGES:
        target = (current / f"{name}.tar").resolve()
        assert target.parent == (scratch / "images").resolve() and target.exists(), name
    assert not (current / "epp.tar").exists() and not (current / "fakes.tar").exists()


def test_images_sh_refuses_an_unknown_image_set(scratch: Path) -> None:
    result = run("images.sh", scratch, TALLY_IMAGE_SET="everything")
    assert result.returncode == 2
    assert "TALLY_IMAGE_SET" in result.stderr

"""The CPU engine's default thread count follows the cgroup's CPU limit: what a pod with `cpu: 500m` sees
(read from a real pod of the test node: cgroup v1, its own cgroup mounted at /sys/fs/cgroup/cpu, the host's
path in /proc/self/cgroup), what a process on a host sees, and cgroup v2."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tally_runtime.cpu_limit import cgroup_paths, cpu_limit, parse_cfs, parse_cpu_max, threads_for
from tally_runtime.engine.llamacpp import LlamaCppEngine

POD_V1 = ("4:memory:/tally-a1/kubepods/pod1/c0ffee\n2:cpuacct:/tally-a1/kubepods/pod1/c0ffee\n"
          "1:cpu:/tally-a1/kubepods/pod1/c0ffee\n0::/tally-a1/kubepods/pod1/c0ffee\n")


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(("text", "cpus"), [("50000 100000\n", 0.5), ("max 100000\n", None), ("200000 100000", 2.0),
                                            ("", None), ("x 100000", None), ("0 100000", None), ("-5 0", None)])
def test_cgroup_v2_cpu_max(text: str, cpus: float | None) -> None:
    assert parse_cpu_max(text) == cpus


def test_cgroup_v1_quota() -> None:
    assert parse_cfs("50000\n", "100000\n") == 0.5
    assert parse_cfs("-1\n", "100000\n") is None
    assert parse_cfs("garbage", "100000") is None


def test_paths_of_both_hierarchies() -> None:
    assert cgroup_paths(POD_V1) == ("/tally-a1/kubepods/pod1/c0ffee", "/tally-a1/kubepods/pod1/c0ffee")
    assert cgroup_paths("12:cpu,cpuacct:/a\n") == (None, "/a")
    assert cgroup_paths("0::/b\n") == ("/b", None)
    assert cgroup_paths("nonsense\n") == (None, None)


@pytest.mark.parametrize(("cores", "limit", "threads"), [(2, 0.5, 1), (2, None, 2), (8, 1.5, 2), (2, 4.0, 2),
                                                         (4, 1.0, 1), (1, 0.1, 1), (0, None, 1)])
def test_threads_are_whole_cpus_of_the_limit_within_the_cores(cores: int, limit: float | None, threads: int) -> None:
    assert threads_for(cores, limit) == threads


def test_a_pod_sees_its_quota_at_the_mounts_root(tmp_path: Path) -> None:
    root = tree(tmp_path, {"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cpu_limit(root, POD_V1) == 0.5


def test_a_host_process_reads_its_own_cgroup_not_the_roots(tmp_path: Path) -> None:
    root = tree(tmp_path, {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
                           "cpu,cpuacct/svc/cpu.cfs_quota_us": "150000\n",
                           "cpu,cpuacct/svc/cpu.cfs_period_us": "100000\n"})
    assert cpu_limit(root, "3:cpu,cpuacct:/svc\n") == 1.5
    assert cpu_limit(root, "3:cpu,cpuacct:/\n") is None


def test_cgroup_v2_and_the_tightest_of_several(tmp_path: Path) -> None:
    root = tree(tmp_path, {"cpu.max": "max 100000\n", "k/pod/cpu.max": "25000 100000\n",
                           "cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cpu_limit(root, "0::/k/pod\n") == 0.25
    assert cpu_limit(tmp_path / "nothing-here", "0::/k/pod\n") is None


def test_the_engine_takes_the_limit_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tally_runtime.engine.llamacpp.usable_threads", lambda: (1, 0.5))
    assert LlamaCppEngine(Path("m.gguf"), 512, 1).threads == 1
    assert LlamaCppEngine(Path("m.gguf"), 512, 1, threads=3).threads == 3


def test_a_process_under_a_real_quota_takes_the_limits_whole_cpus() -> None:
    """The kernel's own files: a child placed in a cgroup with a 0.5-CPU quota (benchmarks/cpu_limit.py makes
    it, as a pod's limit does) reads 0.5 and takes one thread."""
    spec = importlib.util.spec_from_file_location("bench_cpu_limit",
                                                  Path(__file__).parents[3] / "benchmarks" / "cpu_limit.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    try:
        group = bench.make_cgroup(0.5)
    except OSError as err:
        pytest.skip(f"no writable cgroup cpu controller here: {err}")
    try:
        done = subprocess.run(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$1" -c "$2"', str(group),
                               sys.executable, "from tally_runtime.cpu_limit import usable_threads; "
                               "print(usable_threads())"], capture_output=True, text=True, timeout=60)
    finally:
        group.rmdir()
    assert done.stdout.strip() == "(1, 0.5)", done.stderr

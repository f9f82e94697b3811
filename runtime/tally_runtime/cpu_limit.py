"""How many CPU threads this process can use: the cores it may run on, bounded by its cgroup's CPU limit.

A pod with `cpu: 500m` still sees every core of its node (`os.cpu_count()`, `nproc`), but the kernel gives
it 50 ms of CPU time per 100 ms period. llama.cpp's decode threads wait for each other by spinning, so more
threads than the limit spend the quota spinning and are then throttled: on this machine, 2 threads under a
0.5-CPU limit decoded 35% slower than 1 (benchmarks/cpu_limit.py). The limit is read from cgroup v2's
`cpu.max` or v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`, at the process's own cgroup path (a process on
a host) or at the mount's root (a container, which sees its own cgroup there).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("<quota> <period>", quota "max" for none) -> CPUs, or None."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return _ratio(parts[0], parts[1])


def parse_cfs(quota: str, period: str) -> float | None:
    """cgroup v1 `cpu.cfs_quota_us` (-1 for none) and `cpu.cfs_period_us` -> CPUs, or None."""
    return _ratio(quota.strip(), period.strip())


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_paths(proc_self_cgroup: str) -> tuple[str | None, str | None]:
    """/proc/self/cgroup -> (the v2 path, the v1 `cpu` controller's path), each None if absent."""
    v2 = v1 = None
    for line in proc_self_cgroup.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        if fields[0] == "0" and fields[1] == "":
            v2 = fields[2]
        elif "cpu" in fields[1].split(","):
            v1 = fields[2]
    return v2, v1


def threads_for(cores: int, limit: float | None) -> int:
    """Whole threads for `cores` usable cores under a CPU `limit` (None: no limit), at least one."""
    if limit is None:
        return max(1, cores)
    return max(1, min(cores, math.ceil(limit - 1e-9)))


def cpu_limit(root: Path = CGROUP_ROOT, proc_self_cgroup: str | None = None) -> float | None:
    """The tightest CPU limit found for this process's cgroup, or None (no limit, or nothing readable)."""
    if proc_self_cgroup is None:
        proc_self_cgroup = _read(Path("/proc/self/cgroup")) or ""
    v2, v1 = cgroup_paths(proc_self_cgroup)
    found: list[float] = []
    for base in _bases(root, v2):
        text = _read(base / "cpu.max")
        limit = parse_cpu_max(text) if text is not None else None
        if limit is not None:
            found.append(limit)
    for controller in ("cpu", "cpu,cpuacct"):
        for base in _bases(root / controller, v1):
            quota, period = _read(base / "cpu.cfs_quota_us"), _read(base / "cpu.cfs_period_us")
            limit = parse_cfs(quota, period) if quota is not None and period is not None else None
            if limit is not None:
                found.append(limit)
    return min(found) if found else None


def _bases(mount: Path, own: str | None) -> list[Path]:
    """The process's own cgroup under `mount` (seen from a host) and the mount's root (seen from a container)."""
    bases = [mount]
    if own and own != "/":
        bases.insert(0, mount / own.lstrip("/"))
    return bases


def _read(path: Path, limit: int = 64 << 10) -> str | None:
    """A small kernel file's text (at most `limit` bytes: what is past it is not read), or None."""
    try:
        with path.open("rb") as file:
            return file.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def usable_threads() -> tuple[int, float | None]:
    """Threads this process can keep busy, and the CPU limit they follow (None: none)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    limit = cpu_limit()
    return threads_for(cores, limit), limit

#!/usr/bin/env python3
"""Make kwok's fake pods real: run a `tally-runtime` on each managed pod's (loopback) IP.

For every Running pod labelled app.kubernetes.io/managed-by=tally-operator whose IP is in 127.0.0.0/8,
start `tally-runtime` with the pod's own container arguments, bound to the pod IP instead of 0.0.0.0,
and stop it when the pod goes away. Only the CPU engine runs here; pods of other engines are left alone
unless a `command_for` hook (tests) says how to run them.

    python hack/pod_runner.py [--namespace NS] [--log-dir DIR]     (KUBECONFIG selects the cluster)
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

MANAGED = "app.kubernetes.io/managed-by=tally-operator"
Pod = dict[str, Any]


def runtime_command(pod: Pod) -> list[str] | None:
    """The pod's container args, bound to its IP; None for pods this runner cannot serve."""
    container = pod["spec"]["containers"][0]
    args = list(container.get("args") or [])
    if "--engine" in args and args[args.index("--engine") + 1] != "cpu":
        return None
    if "--host" in args:
        args[args.index("--host") + 1] = pod["status"]["podIP"]
    return [sys.executable, "-m", "tally_runtime", *args, "--cpu-threads", "1"]


def is_servable(pod: Pod) -> bool:
    ip = (pod.get("status") or {}).get("podIP")
    running = (pod.get("status") or {}).get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")
    return bool(running and ip and ipaddress.ip_address(ip).is_loopback)


class PodRunner:
    def __init__(self, env: dict[str, str], log_dir: Path, namespace: str | None = None,
                 command_for: Callable[[Pod], list[str] | None] = runtime_command) -> None:
        self.env = env
        self.log_dir = log_dir
        self.namespace = namespace
        self.command_for = command_for
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = threading.Event()
        log_dir.mkdir(parents=True, exist_ok=True)

    def pods(self) -> list[Pod]:
        scope = ["-n", self.namespace] if self.namespace else ["-A"]
        out = subprocess.run(["kubectl", "get", "pods", *scope, "-l", MANAGED, "-o", "json"], env=self.env,
                             capture_output=True, text=True, timeout=30)
        return list(json.loads(out.stdout)["items"]) if out.returncode == 0 else []

    def sync(self) -> None:
        wanted = {p["metadata"]["uid"]: p for p in self.pods() if is_servable(p)}
        for uid in set(self.procs) - set(wanted):
            self.stop(uid)
        for uid, pod in wanted.items():
            proc = self.procs.get(uid)
            if proc is not None and proc.poll() is None:
                continue
            command = self.command_for(pod)
            if command is None:
                continue
            log = (self.log_dir / f"{pod['metadata']['namespace']}.{pod['metadata']['name']}.log").open("ab")
            env = {**os.environ, **self.env}
            self.procs[uid] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True)

    def kill(self, pod_uid: str) -> None:
        """Simulate a crash: the process dies; the next sync starts a fresh one (counters at zero)."""
        proc = self.procs.get(pod_uid)
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)

    def stop(self, uid: str) -> None:
        proc = self.procs.pop(uid, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()

    def run(self, interval: float = 0.5) -> None:
        while not self.stopping.is_set():
            self.sync()
            self.stopping.wait(interval)

    def close(self) -> None:
        self.stopping.set()
        for uid in list(self.procs):
            self.stop(uid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--namespace")
    parser.add_argument("--log-dir", default=".tally/pods")
    args = parser.parse_args()
    runner = PodRunner(dict(os.environ), Path(args.log_dir), args.namespace)
    signal.signal(signal.SIGTERM, lambda *_: runner.stopping.set())
    try:
        runner.run()
    except KeyboardInterrupt:
        pass
    finally:
        runner.close()


if __name__ == "__main__":
    main()

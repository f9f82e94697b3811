#!/usr/bin/env python3
"""Make kwok's fake pods real: run a `tally-runtime` on each managed pod's (loopback) IP, as a kubelet would.

For every Running pod labelled app.kubernetes.io/managed-by=tally-operator whose IP is in 127.0.0.0/8,
start `tally-runtime` with the pod's own container arguments, bound to the pod IP instead of 0.0.0.0.
Like a kubelet, the runner holds the pod (a finalizer) while its process runs: a deleted pod stays
Terminating while its runtime gets SIGTERM and drains, and is released once the process has exited
(or its grace period ran out: SIGKILL). A process that dies is started again with the same pod volume,
so its counter journal survives, as an emptyDir survives a container restart. Only the CPU engine runs
here; pods of other engines are left alone unless a `command_for` hook (tests) says how to run them.

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MANAGED = "app.kubernetes.io/managed-by=tally-operator"
FINALIZER = "tally.dev/pod-runner"
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


def grace_seconds(pod: Pod) -> float:
    meta = pod["metadata"]
    return float(meta.get("deletionGracePeriodSeconds") or pod["spec"].get("terminationGracePeriodSeconds") or 30)


class PodRunner:
    def __init__(self, env: dict[str, str], log_dir: Path, namespace: str | None = None,
                 command_for: Callable[[Pod], list[str] | None] = runtime_command) -> None:
        self.env = env
        self.log_dir = log_dir
        self.namespace = namespace
        self.command_for = command_for
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.terminating: dict[str, float] = {}  # pod uid -> when its grace period ends
        self.stopping = threading.Event()
        self.syncing = threading.Condition()
        log_dir.mkdir(parents=True, exist_ok=True)

    def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["kubectl", *args], env=self.env, capture_output=True, text=True, timeout=30)

    def pods(self) -> list[Pod]:
        scope = ["-n", self.namespace] if self.namespace else ["-A"]
        out = self.kubectl("get", "pods", *scope, "-l", MANAGED, "-o", "json")
        return list(json.loads(out.stdout)["items"]) if out.returncode == 0 else []

    def sync(self) -> None:
        pods = {p["metadata"]["uid"]: p for p in self.pods()}
        for uid, pod in pods.items():
            if pod["metadata"].get("deletionTimestamp"):
                self.terminate(uid, pod)
            elif is_servable(pod):
                self.serve(uid, pod)
        for uid in set(self.procs) - set(pods):  # gone without us (a forced deletion): stop at once
            self.stop(uid)

    def serve(self, uid: str, pod: Pod) -> None:
        proc = self.procs.get(uid)
        if proc is not None and proc.poll() is None:
            return
        command = self.command_for(pod)
        if command is None:
            return
        if FINALIZER not in (pod["metadata"].get("finalizers") or []):
            self.patch(pod, {"metadata": {"finalizers": [*(pod["metadata"].get("finalizers") or []), FINALIZER]}})
        volume = self.log_dir / "volumes" / uid  # the pod's emptyDir: kept across restarts of its process
        volume.mkdir(parents=True, exist_ok=True)
        if "--journal-path" in command:
            command[command.index("--journal-path") + 1] = str(volume / "usage.json")
        log = self.log_dir / f"{pod['metadata']['namespace']}.{pod['metadata']['name']}.log"
        with log.open("ab") as out:
            self.procs[uid] = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                               env={**os.environ, **self.env}, start_new_session=True)

    def terminate(self, uid: str, pod: Pod) -> None:
        """A deleted pod: SIGTERM once, SIGKILL after its grace period, release it once the process is gone."""
        proc = self.procs.get(uid)
        if proc is not None and proc.poll() is None:
            if uid not in self.terminating:
                self.terminating[uid] = time.monotonic() + grace_seconds(pod)
                proc.send_signal(signal.SIGTERM)
            elif time.monotonic() > self.terminating[uid]:
                proc.kill()
            return
        self.procs.pop(uid, None)
        self.terminating.pop(uid, None)
        finalizers = pod["metadata"].get("finalizers") or []
        if FINALIZER in finalizers:
            self.patch(pod, {"metadata": {"finalizers": [f for f in finalizers if f != FINALIZER] or None}})

    def patch(self, pod: Pod, change: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self.kubectl("patch", "pod", meta["name"], "-n", meta["namespace"], "--type=merge", "-p", json.dumps(change))

    def kill(self, pod_uid: str) -> None:
        """Simulate a crash: the process dies; the next sync starts it again on the same pod volume."""
        proc = self.procs.get(pod_uid)
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)

    def stop(self, uid: str) -> None:
        proc = self.procs.pop(uid, None)
        self.terminating.pop(uid, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()

    def run(self, interval: float = 0.5) -> None:
        with self.syncing:
            while not self.stopping.is_set():
                self.sync()
                self.syncing.wait(interval)

    def close(self) -> None:
        """Stop the sync loop, then every runtime, and release every pod still held, so namespaces can go."""
        with self.syncing:  # a sync in progress finishes first: nothing starts after this
            self.stopping.set()
            self.syncing.notify_all()
        for uid in list(self.procs):
            self.stop(uid)
        for pod in self.pods():
            finalizers = pod["metadata"].get("finalizers") or []
            if FINALIZER in finalizers:
                self.patch(pod, {"metadata": {"finalizers": [f for f in finalizers if f != FINALIZER] or None}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--namespace")
    parser.add_argument("--log-dir", default=".tally/pods")
    args = parser.parse_args()
    runner = PodRunner(dict(os.environ), Path(args.log_dir), args.namespace)
    signal.signal(signal.SIGTERM, lambda *_: runner.stopping.set())  # run() ends after its current sync
    try:
        runner.run()
    except KeyboardInterrupt:
        pass
    finally:
        runner.close()


if __name__ == "__main__":
    main()

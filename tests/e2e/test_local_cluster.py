"""The local cluster is safe on someone's machine: `down` kills nothing on a stale pid file, the SOCKS relay
admits only its owner and reaches only pods, Services and the API server, etcd refuses anyone but the API
server, and cluster DNS resolves the endpoint a CompletionService's status prints."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kube_harness import HACK, TEST_CLUSTER, Kubectl, cluster_netns, eventually
from operator_harness import ChartOperator
from usage_harness import service

pytestmark = pytest.mark.e2e

CLUSTER_DIR = Path(TEST_CLUSTER["TALLY_CLUSTER_DIR"])
PROXY_PORT = int(TEST_CLUSTER["TALLY_PROXY_PORT"])


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """An ordinary process of this machine, in its own mount namespace, as any user's would be."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def node_down(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """hack/node.sh down for a node whose directory is `tmp_path` (nothing of the tests' cluster)."""
    env = {**os.environ, "DIR": str(tmp_path), "RUN": str(tmp_path / "run"), "LOGS": str(tmp_path / "logs"),
           "NETNS": f"tally-stale{uuid.uuid4().hex[:6]}"}
    return subprocess.run([str(HACK / "node.sh"), "down"], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("netns", ["", "..", "a b", "/"])
def test_node_sh_refuses_an_empty_or_odd_namespace_before_it_names_anything(
        tmp_path: Path, bystander: subprocess.Popen[bytes], netns: str) -> None:
    """An empty NETNS made the node's cgroup the root cgroup, whose every process `down` would kill."""
    env = {**os.environ, "DIR": str(tmp_path), "RUN": str(tmp_path / "run"), "LOGS": str(tmp_path / "logs"),
           "NETNS": netns}
    done = subprocess.run([str(HACK / "node.sh"), "down"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "NETNS a plain name" in done.stderr
    assert bystander.poll() is None


def record(pid: int, *extra: str) -> str:
    start = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return " ".join((str(pid), start, boot, *extra)) + "\n"


@pytest.mark.parametrize("pid_file", [
    pytest.param(lambda pid: f"{pid}\n", id="bare-pid-of-an-older-format"),
    pytest.param(lambda pid: f"{pid} 1 {uuid.uuid4()}\n", id="pid-reused-after-a-reboot"),
    pytest.param(lambda pid: record(pid, os.readlink("/proc/self/ns/mnt")), id="recorded-but-the-machines-own-ns"),
    pytest.param(lambda pid: record(pid, "mnt:[1]"), id="recorded-with-another-namespace"),
])
def test_down_on_a_stale_holder_pid_kills_nothing_outside_the_node_and_says_why(
        tmp_path: Path, bystander: subprocess.Popen[bytes], pid_file: Any) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "run" / "node-holder.pid").write_text(pid_file(bystander.pid))
    (tmp_path / "run" / "kubelet.pid").write_text(f"{bystander.pid}\n")
    done = node_down(tmp_path)
    assert done.returncode == 0, done.stderr
    assert bystander.poll() is None, "an ordinary process of this machine was killed"
    assert "nothing is killed by namespace" in done.stderr or "not killing by mount namespace" in done.stderr


def socks_connect(host: str, port: int, user: bytes = b"tally", password: bytes | None = None,
                  methods: bytes = b"\x02", address: bytes | None = None) -> int:
    """One SOCKS5 CONNECT through the tests' relay; the reply code (or -1 when refused at authentication)."""
    secret = (CLUSTER_DIR / "proxy.secret").read_bytes().strip() if password is None else password
    with socket.create_connection(("127.0.0.1", PROXY_PORT), timeout=10) as sock:
        sock.sendall(bytes((5, len(methods))) + methods)
        if sock.recv(2) != b"\x05\x02":
            return -1
        sock.sendall(bytes((1, len(user))) + user + bytes((len(secret),)) + secret)
        if sock.recv(2) != b"\x01\x00":
            return -1
        target = address or (b"\x01" + socket.inet_aton(host))
        sock.sendall(b"\x05\x01\x00" + target + struct.pack("!H", port))
        return sock.recv(10)[1]


def test_the_relay_admits_its_owner_only_and_reaches_only_pods_services_and_the_api(kubectl: Kubectl) -> None:
    etcd = int(TEST_CLUSTER["TALLY_ETCD_PORT"])
    # the kubernetes Service: allowed (a cluster just started may not have programmed its Service rules yet)
    eventually(lambda: socks_connect("198.19.0.1", 443) == 0, 60, interval=1, what="the kubernetes Service")
    assert socks_connect("198.18.0.1", 6443) == 0  # the API server on the node: allowed
    assert socks_connect("127.0.0.1", etcd) == 2  # etcd on the namespace's loopback: not allowed
    assert socks_connect("198.18.0.1", 10250) == 2  # the kubelet: not allowed
    assert socks_connect("10.0.0.1", 80) == 2  # outside the cluster's ranges
    name = b"localhost"
    assert socks_connect("", 80, address=b"\x03" + bytes((len(name),)) + name) == 8  # names: never
    assert socks_connect("198.19.0.1", 443, password=b"guessed-wrong-0123456789") == -1
    assert socks_connect("198.19.0.1", 443, methods=b"\x00") == -1  # no authentication offered: refused
    secret = CLUSTER_DIR / "proxy.secret"
    assert secret.stat().st_mode & 0o777 == 0o600 and CLUSTER_DIR.stat().st_mode & 0o777 == 0o700
    other_user = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", str(secret)],
                                capture_output=True, timeout=30)
    assert other_user.returncode != 0 and not other_user.stdout  # another local user cannot read it
    env_line = subprocess.run([str(HACK / "cluster.sh"), "env"], env={**os.environ, **TEST_CLUSTER},
                              capture_output=True, text=True, timeout=30, check=True).stdout
    curlrc = CLUSTER_DIR / "curlrc"  # curl -K reads the relay's password from it, never a command line
    assert f"TALLY_CURLRC={curlrc}" in env_line and curlrc.stat().st_mode & 0o777 == 0o600
    assert secret.read_text().strip() in curlrc.read_text()


def test_etcd_refuses_every_client_but_the_api_server(kubectl: Kubectl) -> None:
    pki, port = CLUSTER_DIR / "pki", TEST_CLUSTER["TALLY_ETCD_PORT"]

    def curl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["nsenter", f"--net=/run/netns/{cluster_netns()}", "curl", "-s", "--max-time", "5",
                               *args], capture_output=True, text=True, timeout=30)

    health = f"https://127.0.0.1:{port}/health"
    assert curl(f"http://127.0.0.1:{port}/health").returncode != 0  # no plain HTTP
    assert curl("--cacert", str(pki / "etcd-ca.crt"), health).returncode != 0  # no client certificate
    assert curl("--cacert", str(pki / "etcd-ca.crt"), "--cert", str(pki / "admin.crt"), "--key",
                str(pki / "admin.key"), health).returncode != 0  # the cluster's admin is not an etcd client
    ok = curl("--cacert", str(pki / "etcd-ca.crt"), "--cert", str(pki / "etcd-client.crt"), "--key",
              str(pki / "etcd-client.key"), health)
    assert ok.returncode == 0 and '"health":"true"' in ok.stdout  # the API server's own certificate


def test_a_client_pod_streams_from_the_endpoint_the_status_prints(operator: ChartOperator, kube: Kubectl) -> None:
    kube.apply(service(replicas=1))
    endpoint = eventually(lambda: (kube.json("get", "completionservice", "smollm").get("status") or {}).get(
        "endpoint"), 60, what="status.endpoint")
    assert endpoint == f"http://smollm.{kube.namespace}.svc.cluster.local:8000/v1"
    eventually(lambda: (kube.json("get", "completionservice", "smollm").get("status") or {}).get("readyReplicas"),
               300, interval=1, what="a ready runtime pod")
    kube("create", "job", "by-name", "--image=tally-client:0.1.0", "--", "tally-demo-client", endpoint,
         "--requests", "1")
    eventually(lambda: kube.json("get", "job", "by-name").get("status", {}).get("succeeded") == 1, 180, interval=1,
               what="the client job, by name")
    assert '"completion"' in kube("logs", "job/by-name")
    assert "MissingClusterDNS" not in kube("get", "events", "-o", "jsonpath={.items[*].reason}")


def test_down_finds_and_removes_the_nodes_cgroups_when_the_clusters_directory_is_gone(tmp_path: Path) -> None:
    """A cgroup tree the kubelet left (`<hierarchy>/tally-<id>/kubepods/...`) with a process still in it, and no
    cluster directory any more (a first `down` removed it): `cluster.sh down` must kill what is in the tree,
    remove it deepest first, and leave `leftovers.sh` nothing to report."""
    import hashlib

    gone = tmp_path / "cluster"  # never created: the state is gone
    netns = "tally-" + hashlib.sha256(f"{gone}\n".encode()).hexdigest()[:8]  # as cluster.sh names it
    hierarchies = [h for h in ("pids", "memory", "cpu") if (Path("/sys/fs/cgroup") / h / "cgroup.procs").exists()]
    assert hierarchies, "cgroup v1 hierarchies"
    straggler = subprocess.Popen(["sleep", "300"])
    try:
        for hierarchy in hierarchies:
            deepest = Path("/sys/fs/cgroup") / hierarchy / netns / "kubepods" / "burstable" / "pod-left"
            deepest.mkdir(parents=True)
            (deepest / "cgroup.procs").write_text(str(straggler.pid))

        down = subprocess.run([str(HACK / "cluster.sh"), "down"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TALLY_CLUSTER_DIR": str(gone)})

        assert down.returncode == 0, down.stderr
        assert straggler.wait(timeout=10) == -9  # killed by down, as a shim left in the tree would be
        assert not [h for h in hierarchies if (Path("/sys/fs/cgroup") / h / netns).exists()]
        left = subprocess.run([str(HACK / "leftovers.sh"), str(gone)], capture_output=True, text=True, timeout=60)
        assert left.returncode == 0, left.stderr
    finally:
        straggler.kill()
        straggler.wait()
        for hierarchy in hierarchies:
            root = Path("/sys/fs/cgroup") / hierarchy / netns
            if root.exists():
                subprocess.run(["find", str(root), "-depth", "-type", "d", "-exec", "rmdir", "{}", "+"], check=False)

"""The local control plane for tests: bring it up once (or reuse it), run kubectl, poll with deadlines."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
HACK = ROOT / "hack"

# The tests' own cluster: its own state, network namespace and loopback ports, so that `make run`'s cluster
# can stay up while the suite runs without either seeing the other.
TEST_CLUSTER = {
    "TALLY_CLUSTER_DIR": str(ROOT / ".tally" / "test-cluster"), "TALLY_ETCD_PORT": "23890",
    "TALLY_API_PORT": "16543", "TALLY_PROXY_PORT": "16580", "TALLY_KCM_PORT": "20357", "TALLY_SCHEDULER_PORT": "20359",
    "TALLY_KWOK_PORT": "20347", "TALLY_POD_NET": "127.11", "TALLY_KWOK_CIDR": "127.21.0.0/16",
}

# Pods and ClusterIPs live in the cluster's network namespace; this machine reaches them through the
# cluster's SOCKS5 relay (hack/netns_relay.py --socks), with the credentials `cluster.sh env` prints.
_proxy: list[str] = []

# kwok's GPU nodes carry a taint of their own besides the GPU one: only pods that ask for a fake node land
# there (the CPU example otherwise schedules onto the cluster's real node).
FAKE_NODE_TOLERATIONS = [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]


def _cluster(command: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HACK / "cluster.sh"), command], env={**os.environ, **TEST_CLUSTER}, text=True,
                          **kwargs)


def cluster_is_up() -> bool:
    return _cluster("status", capture_output=True, timeout=60).returncode == 0


def cluster_down() -> None:
    _cluster("down", check=True, timeout=120)


def cluster_env() -> dict[str, str]:
    """Bring the tests' cluster up (idempotent) and return an environment that points kubectl and helm at it."""
    _cluster("up", check=True, timeout=600)
    line = _cluster("env", check=True, capture_output=True, timeout=60).stdout.split()
    exported = dict(word.split("=", 1) for word in line if "=" in word)  # export KUBECONFIG=... TALLY_PROXY=...
    _proxy[:] = [exported["TALLY_PROXY"]]
    bin_dir = subprocess.run([str(HACK / "build.sh"), "--print"], check=True, capture_output=True, text=True,
                             timeout=60).stdout.strip()
    return {**os.environ, **exported, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def in_cluster(timeout: float = 30) -> httpx.Client:
    """An HTTP client whose connections open inside the cluster: to pod IPs and Service ClusterIPs."""
    if not _proxy:
        raise RuntimeError("the tests' cluster is not up (cluster_env() first)")
    return httpx.Client(proxy=_proxy[0], timeout=timeout)


def tcp_reaches(host: str, port: int, timeout: float = 5) -> bool:
    """Whether a TCP connection to an IPv4 `host:port` opens from inside the cluster, nothing sent on it: a
    Service's ClusterIP answers only once kube-proxy has programmed its endpoints, which lags behind the
    EndpointSlices on a loaded node (a SOCKS5 CONNECT through the relay, RFC 1928/1929)."""
    if not _proxy:
        raise RuntimeError("the tests' cluster is not up (cluster_env() first)")
    proxy = httpx.URL(_proxy[0])
    user, password = proxy.username.encode(), proxy.password.encode()
    try:
        with socket.create_connection((proxy.host, proxy.port or 1080), timeout=timeout) as sock:
            sock.sendall(b"\x05\x01\x02")  # SOCKS5, one method offered: username and password
            if sock.recv(2) != b"\x05\x02":
                return False
            sock.sendall(b"\x01" + bytes([len(user)]) + user + bytes([len(password)]) + password)
            if sock.recv(2)[1:2] != b"\x00":
                return False
            sock.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(host) + port.to_bytes(2, "big"))
            reply = sock.recv(10)
            return len(reply) >= 2 and reply[1] == 0  # 0: connected; 3, 4, 5: network, host, port refused
    except OSError:
        return False


def cluster_netns() -> str:
    return _cluster("netns", check=True, capture_output=True, timeout=60).stdout.strip()


def container_id(pod: dict[str, Any]) -> str:
    return str(pod["status"]["containerStatuses"][0]["containerID"]).removeprefix("containerd://")


def node_ctr(env: dict[str, str], *args: str) -> str:
    """containerd's own client against the tests' real node (what only the node's owner can do: kill a task)."""
    socket = Path(TEST_CLUSTER["TALLY_CLUSTER_DIR"]) / "node" / "run" / "containerd.sock"
    done = subprocess.run(["ctr", "--address", str(socket), "-n", "k8s.io", *args], capture_output=True, text=True,
                          env=env, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"ctr {' '.join(args)} failed: {done.stderr}")
    return done.stdout


def node_exec(env: dict[str, str], container: str, *command: str) -> str:
    """A command in a running container (`ctr tasks exec`), run inside the node's own mount namespace,
    where containerd keeps the FIFOs an exec talks through."""
    cluster = Path(TEST_CLUSTER["TALLY_CLUSTER_DIR"])
    holder = (cluster / "run" / "node-holder.pid").read_text().split()[0]
    ctr = shutil.which("ctr", path=env["PATH"])
    assert ctr is not None, "ctr is not on the cluster's PATH"
    done = subprocess.run(["nsenter", "-t", holder, "-m", "-n", "--", ctr, "--address",
                           str(cluster / "node" / "run" / "containerd.sock"), "-n", "k8s.io", "tasks", "exec",
                           "--exec-id", f"exec-{uuid.uuid4().hex[:8]}", container, *command],
                          capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"ctr tasks exec {' '.join(command)} failed: {done.stderr}")
    return done.stdout


class Kubectl:
    def __init__(self, env: dict[str, str], namespace: str | None = None) -> None:
        self.env = env
        self.namespace = namespace

    def __call__(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        ns = ["-n", self.namespace] if self.namespace else []
        done = subprocess.run(["kubectl", *ns, *args], input=stdin, capture_output=True, text=True,
                              env=self.env, timeout=120)
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {done.stderr}")
        return done.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json"))

    def apply(self, manifest: dict[str, Any] | str) -> str:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return self("apply", "-f", "-", stdin=text)

    def in_namespace(self, namespace: str) -> Kubectl:
        return Kubectl(self.env, namespace)


def token_kubeconfig(kubectl: Kubectl, token: str, path: Path) -> Path:
    """A kubeconfig for the same cluster that authenticates with `token` only (no admin certificate)."""
    cluster = kubectl.json("config", "view", "--raw", "--minify")["clusters"][0]["cluster"]
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}],
    }))
    return path


def reachable_cluster_ip(kube: Kubectl, service: str, port: int, deadline: float = 60) -> str:
    """`service`'s ClusterIP once a connection to `port` opens there: kube-proxy programs a Service's
    endpoints a little after the EndpointSlices say ready, and until then rejects connections to it (a
    client then sees "host unreachable" for a request it never sent)."""
    ip = str(kube.json("get", "service", service)["spec"]["clusterIP"])
    eventually(lambda: tcp_reaches(ip, port), deadline, interval=0.5, what=f"{service}'s ClusterIP taking connections")
    return ip


def eventually(check: Callable[[], Any], deadline: float, interval: float = 0.25, what: str = "condition") -> Any:
    """Poll `check` until it returns something truthy; fail with the last value after `deadline` seconds."""
    end = time.monotonic() + deadline
    last: Any = None
    while time.monotonic() < end:
        try:
            last = check()
        except (RuntimeError, KeyError, IndexError, ValueError) as err:
            last = err
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached in {deadline}s; last: {last!r}")

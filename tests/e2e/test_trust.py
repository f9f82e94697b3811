"""A CompletionService grants no more than a service, and its API keys name tenants: on the real cluster.

The chart's ValidatingAdmissionPolicy refuses a forbidden spec before it reaches etcd (the CRD's own CEL
refuses a Secret in the environment); with the policy unbound, the operator refuses it and says why. A
same-named Service of someone else's is left alone. Keys from a Secret name the tenant, a spoofed tenant
header is ignored, and updating the Secret rotates the keys without a restart.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from kube_harness import Kubectl, eventually, in_cluster
from operator_harness import ChartOperator
from usage_harness import MODEL, service, serving_pods

pytestmark = pytest.mark.e2e

POLICY = "tally-operator"  # the chart's ValidatingAdmissionPolicy and its binding


def condition(kube: Kubectl, kind: str, name: str = "smollm") -> dict[str, Any]:
    status = kube.json("get", "completionservice", name).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def forbidden(volume: dict[str, Any] | None = None, **engine: Any) -> dict[str, Any]:
    manifest = service(replicas=1)
    if volume:
        manifest["spec"]["model"]["volume"] = volume
    manifest["spec"]["engine"].update(engine)
    return manifest


def refused_on_apply(kube: Kubectl, manifest: dict[str, Any]) -> str:
    done = subprocess.run(["kubectl", "-n", str(kube.namespace), "apply", "-f", "-"], input=json.dumps(manifest),
                          capture_output=True, text=True, env=kube.env, timeout=60)
    assert done.returncode != 0, "the API server took a forbidden CompletionService"
    return done.stderr


@pytest.fixture
def unbound(kubectl: Kubectl, operator: ChartOperator) -> Iterator[None]:
    """The admission policy's binding removed (as on a cluster without it), restored afterwards."""
    binding = kubectl.json("get", "validatingadmissionpolicybinding", POLICY)
    kubectl("delete", "validatingadmissionpolicybinding", POLICY)
    probe = json.dumps({**forbidden({"hostPath": {"path": "/etc"}}),
                        "metadata": {"name": "probe", "namespace": "default"}})
    try:
        eventually(lambda: subprocess.run(["kubectl", "apply", "--dry-run=server", "-f", "-"], input=probe,
                                          text=True, env=kubectl.env, capture_output=True,
                                          timeout=60).returncode == 0, 30,
                   what="the API server no longer enforcing the unbound policy")
        yield
    finally:
        for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
            binding["metadata"].pop(key, None)
        kubectl.apply(binding)


def test_the_api_server_refuses_a_completion_service_that_is_more_than_a_service(
        operator: ChartOperator, kube: Kubectl) -> None:
    assert "spec.model.volume may use only" in refused_on_apply(kube, forbidden({"hostPath": {"path": "/etc"}}))
    assert "spec.engine.image must be one of" in refused_on_apply(kube, forbidden(image="evil/runtime:1"))
    secret_env = forbidden(env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])
    assert "literal values only" in refused_on_apply(kube, secret_env)
    assert "TALLY_" in refused_on_apply(kube, forbidden(env=[{"name": "TALLY_API_KEYS_FILE", "value": "/dev/null"}]))
    assert "POD_NAME" in refused_on_apply(kube, forbidden(env=[{"name": "POD_NAME", "value": "someone-else"}]))
    for args in (["--chat-template=x --trust-remote --tokenizer-pa evil-org/evil"], [" --trust-remote"],
                 ["--trust-remote-code"], ["--stream-interval", "2"], ["--log-requests"]):
        assert "one allowed SGLang option" in refused_on_apply(kube, forbidden(args=args)), args
    taint = "node-role.kubernetes.io/control-plane"
    control_plane = forbidden()
    control_plane["spec"]["resources"] = {"gpus": 0, "gpuResourceName": taint}
    control_plane["spec"]["scheduling"] = {"tolerations": [{"key": taint, "operator": "Exists"}]}
    assert "gpuResourceName must be one of" in refused_on_apply(kube, control_plane)
    any_secret = forbidden()
    any_secret["spec"]["auth"] = {"apiKeysSecret": {"name": "db-password"}}
    assert "tally-api-keys" in refused_on_apply(kube, any_secret)
    token_secret = forbidden()
    token_secret["spec"]["usageRecords"] = {"delivery": {"url": "https://meter.example/api/v1/events",
                                                         "tokenSecret": {"name": "db-password"}}}
    assert "tally-usage-delivery" in refused_on_apply(kube, token_secret)
    for name in ("a" * 64, "9-lives"):  # names its Service and pod label could never take
        unusable = forbidden()
        unusable["metadata"]["name"] = name
        assert "DNS-1035 label of at most 63" in refused_on_apply(kube, unusable), name
    assert "smollm" not in kube("get", "completionservices", "-o", "name")
    allowed = forbidden(args=["--stream-interval=2", "--disable-radix-cache"])
    kube("apply", "--dry-run=server", "-f", "-", stdin=json.dumps(allowed))  # what a service may pass is taken


def as_operator(kube: Kubectl, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """kubectl as the operator's ServiceAccount (impersonated: RBAC and admission see its user)."""
    return subprocess.run(["kubectl", "-n", str(kube.namespace), f"--as=system:serviceaccount:tally-system:{POLICY}",
                           *args], capture_output=True, text=True, env=kube.env, timeout=60, input=stdin)


def test_the_operator_changes_only_what_it_owns_and_on_pods_only_the_deletion_cost(
        operator: ChartOperator, kube: Kubectl) -> None:
    """Its RBAC lets it patch pods and Deployments in every namespace; the reach policy confines it to its own
    children, and on pods to the one annotation it sets."""
    kube("create", "deployment", "theirs", "--image=tally-runtime:0.1.0", "--replicas=0")
    changed = as_operator(kube, "set", "image", "deployment/theirs", "*=evil/image:1")
    assert changed.returncode != 0 and "writes only objects it manages" in changed.stderr
    kube.apply(service(replicas=1))
    pod = serving_pods(kube, 1)[0]["metadata"]["name"]
    relabel = as_operator(kube, "label", "pod", pod, "team=evil")
    assert relabel.returncode != 0 and "may change only" in relabel.stderr
    cost = as_operator(kube, "annotate", "--overwrite", "pod", pod, "controller.kubernetes.io/pod-deletion-cost=7")
    assert cost.returncode == 0, cost.stderr
    ours = as_operator(kube, "annotate", "--overwrite", "deployment", "smollm", "example.com/touched=yes")
    assert ours.returncode == 0, ours.stderr  # its own child: allowed


def test_the_operator_binds_only_the_pickers_role_to_the_pickers_account(operator: ChartOperator,
                                                                          kube: Kubectl) -> None:
    """A compromised operator may write RoleBindings (the picker's): the reach policy holds each to the chart's
    picker ClusterRole and the one ServiceAccount named as the binding, so it cannot hand its own rights out."""
    namespace = str(kube.namespace)

    def binding(role: str, subjects: list[dict[str, str]]) -> str:
        return json.dumps({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "chat-epp", "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "tally-operator"},
                         "ownerReferences": [{"apiVersion": "serving.tally.dev/v1alpha1", "kind": "CompletionService",
                                              "name": "chat", "uid": str(uuid.uuid4()), "controller": True}]},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": subjects})

    picker_account = {"kind": "ServiceAccount", "name": "chat-epp", "namespace": namespace}
    everyone = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:authenticated"}
    # RBAC lets it bind the picker's role (and only that one) to any subject: the policy narrows the subject
    for subjects in ([everyone], [picker_account, everyone], [{**picker_account, "name": "default"}]):
        done = as_operator(kube, "create", "--dry-run=server", "-f", "-", stdin=binding(f"{POLICY}-epp", subjects))
        assert done.returncode != 0 and "binds only the endpoint picker's ClusterRole" in done.stderr, subjects
    own = as_operator(kube, "create", "--dry-run=server", "-f", "-", stdin=binding(POLICY, [picker_account]))
    assert own.returncode != 0  # its own role: refused (by RBAC's escalation check or the policy, whichever first)
    allowed = as_operator(kube, "create", "--dry-run=server", "-f", "-", stdin=binding(f"{POLICY}-epp",
                                                                                      [picker_account]))
    assert allowed.returncode == 0, allowed.stderr


def test_the_api_server_refuses_an_environment_the_platform_did_not_allow(operator: ChartOperator,
                                                                         kube: Kubectl) -> None:
    """Each of these ran the author's code: PATH found the author's `tally-runtime` on the model volume, and
    OPENSSL_CONF made the runtime load the author's .so; on GPU nodes CC and Triton's caches are doors too."""
    for name in ("OPENSSL_CONF", "CC", "TRITON_CACHE_DIR", "NCCL_NET_PLUGIN"):
        refused = refused_on_apply(kube, forbidden(env=[{"name": name, "value": "/models/x"}]))
        assert "spec.engine.env may set only" in refused, name
    assert "PATH" in refused_on_apply(kube, forbidden(env=[{"name": "PATH", "value": "/models:/usr/bin"}]))
    tuned = forbidden(env=[{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "OMP_NUM_THREADS", "value": "2"}])
    kube("apply", "--dry-run=server", "-f", "-", stdin=json.dumps(tuned))


@pytest.mark.parametrize(("manifest", "reason"), [
    pytest.param(forbidden({"hostPath": {"path": "/etc"}}), "ForbiddenVolume", id="host-path"),
    pytest.param(forbidden(image="evil/runtime:1"), "ForbiddenImage", id="foreign-image"),
    pytest.param(forbidden(env=[{"name": "OPENSSL_CONF", "value": "/models/openssl.cnf"}]), "ForbiddenEnv",
                 id="openssl-conf"),
])
def test_without_the_policy_the_operator_refuses_it_and_says_why(
        unbound: None, kube: Kubectl, manifest: dict[str, Any], reason: str) -> None:
    kube.apply(manifest)
    ready = eventually(lambda: (r := condition(kube, "Ready")).get("reason") == reason and r, 60,
                       what=f"Ready=False {reason}")
    assert ready["status"] == "False"
    assert kube("get", "deployments", "-o", "name") == ""  # nothing was created for it
    assert reason in kube("get", "events", "-o", "jsonpath={.items[*].message}")


def test_a_same_named_service_of_someone_else_is_left_alone(operator: ChartOperator, kube: Kubectl) -> None:
    theirs = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "smollm", "labels": {"team": "theirs"}},
              "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}}
    kube.apply(theirs)
    kube.apply(service(replicas=1))
    eventually(lambda: condition(kube, "Ready").get("reason") == "NameConflict", 60, what="Ready=False NameConflict")
    after = kube.json("get", "service", "smollm")
    assert after["spec"]["selector"] == {"app": "theirs"} and not after["metadata"].get("ownerReferences")
    kube("delete", "completionservice", "smollm", "--wait=true", "--timeout=60s")
    assert kube.json("get", "service", "smollm")["metadata"]["uid"] == after["metadata"]["uid"]  # still theirs


def call(ip: str, key: str, tenant: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({"X-Tally-Tenant": tenant} if tenant else {})}
    with in_cluster(60) as http:
        return http.post(f"http://{ip}:8000/v1/completions", headers=headers,
                         json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})


def test_keys_from_a_secret_name_the_tenant_and_rotate_without_a_restart(
        operator: ChartOperator, kube: Kubectl) -> None:
    old, new = f"sk-old-{uuid.uuid4().hex}", f"sk-new-{uuid.uuid4().hex}"
    kube("create", "secret", "generic", "tally-api-keys", f"--from-literal=api-keys=team-a {old}\n")
    manifest = service(replicas=1)
    manifest["spec"]["auth"] = {"apiKeysSecret": {"name": "tally-api-keys"}}
    kube.apply(manifest)
    pod = serving_pods(kube, 1)[0]
    ip = pod["status"]["podIP"]
    assert call(ip, old, tenant="team-b").status_code == 200  # the spoofed header is not who pays
    assert call(ip, "sk-guessed-0123456789abcdef").status_code == 401
    with in_cluster(10) as http:
        assert http.get(f"http://{ip}:8000/metrics").status_code == 404  # not on the API's port
        metrics = http.get(f"http://{ip}:8001/metrics").text
    assert 'tally_tenant_requests_total{tenant="team-a"} 1.0' in metrics
    assert 'tenant="team-b"' not in metrics
    patched = subprocess.run(["kubectl", "-n", str(kube.namespace), "create", "secret", "generic", "tally-api-keys",
                              f"--from-literal=api-keys=team-a {new}\n", "--dry-run=client", "-o", "json"],
                             capture_output=True, text=True, env=kube.env, check=True).stdout
    kube("apply", "-f", "-", stdin=patched)
    eventually(lambda: call(ip, new).status_code == 200, 120, interval=1, what="the rotated key accepted")
    assert call(ip, old).status_code == 401
    restarts = kube.json("get", "pod", pod["metadata"]["name"])["status"]["containerStatuses"][0]["restartCount"]
    assert restarts == 0

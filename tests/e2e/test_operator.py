"""The operator on the real local control plane, with the chart's RBAC: reconcile, status, scale, GC."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from kube_harness import FAKE_NODE_TOLERATIONS, ROOT, Kubectl, eventually
from operator_harness import CHART, ChartOperator

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "crds" / "examples" / "smollm-cpu.yaml"


def example(**spec: Any) -> dict[str, Any]:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["scheduling"] = {"tolerations": FAKE_NODE_TOLERATIONS}  # kwok's GPU nodes
    manifest["spec"].update(spec)
    return dict(manifest)


def condition(kube: Kubectl, kind: str, name: str = "smollm") -> dict[str, Any]:
    status = kube.json("get", "completionservice", name).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def deployment(kube: Kubectl, name: str = "smollm") -> dict[str, Any]:
    return dict(kube.json("get", "deployment", name))


def test_chart_lints_and_renders(kubectl: Kubectl) -> None:
    subprocess.run(["helm", "lint", "--strict", str(CHART)], check=True, env=kubectl.env, capture_output=True)
    rendered = subprocess.run(["helm", "template", "t", str(CHART), "--set", "peering.enabled=false"],
                              check=True, env=kubectl.env, capture_output=True, text=True).stdout
    assert "--standalone" in rendered
    bad = subprocess.run(["helm", "template", "t", str(CHART), "--set", "replicaCount=-1"],
                         env=kubectl.env, capture_output=True, text=True)
    assert bad.returncode != 0 and "replicaCount" in bad.stderr
    server = subprocess.run(["kubectl", "apply", "--dry-run=server", "-f", "-"], input=rendered, text=True,
                            env=kubectl.env, capture_output=True)
    assert server.returncode == 0, server.stderr


def test_without_its_crds_the_chart_says_how_to_apply_all_four_and_bad_names_are_refused(kubectl: Kubectl) -> None:
    """Issue 63, item 4: with `crds.enabled=false` NOTES named 1 of the 4 CRDs, with an `https://...` placeholder;
    the values schema accepted a `monitoringNamespace` and a `tokenSecret.name` no API server would."""
    def helm(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["helm", *args], env=kubectl.env, capture_output=True, text=True)

    notes = helm("install", "--dry-run=client", "t", str(CHART), "--set", "crds.enabled=false").stdout
    notes = notes[notes.index("NOTES:"):]
    names = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in (CHART / "files" / "crds").glob("*.yaml")}
    assert len(names) == 4 and all(name in notes for name in names) and "https://..." not in notes
    command = notes[notes.index("helm template"):].split("|")[0].replace("\\\n", " ").replace("<this chart>",
                                                                                               str(CHART))
    rendered = helm(*command.split()[1:])
    assert rendered.returncode == 0, rendered.stderr
    assert {o["metadata"]["name"] for o in yaml.safe_load_all(rendered.stdout) if o} == names
    for value in ("networkPolicy.monitoringNamespace=Monitoring_NS", "usageRecords.delivery.tokenSecret.name=a/b"):
        refused = helm("template", "t", str(CHART), "--set", value)
        assert refused.returncode != 0 and value.split("=")[0].split(".")[-1] in refused.stderr, refused.stderr
    assert helm("template", "t", str(CHART), "--set", "networkPolicy.monitoringNamespace=monitoring").returncode == 0
    # An umbrella chart's global.imageRegistry was ignored: it goes before the operator image and the runtime image
    objects = [o for o in yaml.safe_load_all(helm("template", "t", str(CHART), "--set",
                                                  "global.imageRegistry=mirror.example.com/ml").stdout) if o]
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert pod["image"].startswith("mirror.example.com/ml/tally-operator:")
    runtime = next(e["value"] for e in pod["env"] if e["name"] == "TALLY_OPERATOR_RUNTIME_IMAGE")
    assert runtime.startswith("mirror.example.com/ml/tally-runtime:")


def test_with_an_existing_signing_key_the_chart_renders_the_same_every_time(kubectl: Kubectl) -> None:
    """GitOps tools render with `helm template`, where `lookup` finds nothing: the chart made a new signing key
    on every sync, restarting the operator and rolling every runtime pod. With signingKey.existingSecret it renders
    no key and the same bytes each time, mounting the Secret the platform keeps."""
    def render(*values: str) -> str:
        return subprocess.run(["helm", "template", "t", str(CHART), *values], check=True, env=kubectl.env,
                              capture_output=True, text=True).stdout

    given = ("--set", "signingKey.existingSecret=platform-signing", "--set", "signingKey.key=ed25519.pem")
    first, second = render(*given), render(*given)
    assert first == second
    objects = [o for o in yaml.safe_load_all(first) if o]
    assert not [o for o in objects if o["kind"] == "Secret"]
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]
    assert "checksum/signing-key" not in pod["metadata"].get("annotations", {})
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "signing-key")
    assert volume["secret"]["secretName"] == "platform-signing"
    assert volume["secret"]["items"] == [{"key": "ed25519.pem", "path": "key.pem"}]
    assert render() != render()  # without it a key is made each time (helm install keeps the first: lookup)


def test_the_operators_metrics_are_open_to_the_monitoring_namespace_only(kubectl: Kubectl) -> None:
    """Its /metrics names every namespace's tenants and usage: the chart's policy admits the monitoring
    namespace to that port and nobody when none is named; the liveness port stays open for the kubelet."""
    def policy(*values: str) -> dict[str, Any]:
        rendered = subprocess.run(["helm", "template", "t", str(CHART), *values], check=True, env=kubectl.env,
                                  capture_output=True, text=True).stdout
        return next(o for o in yaml.safe_load_all(rendered) if o and o["kind"] == "NetworkPolicy")

    closed = policy()
    assert closed["spec"]["ingress"] == [{"ports": [{"port": 8080, "protocol": "TCP"}]}]
    assert closed["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "t"
    scraped = policy("--set", "networkPolicy.monitoringNamespace=monitoring")
    metrics, health = scraped["spec"]["ingress"]
    assert metrics["ports"] == [{"port": 9090, "protocol": "TCP"}]
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert health == {"ports": [{"port": 8080, "protocol": "TCP"}]}


def test_the_chart_works_as_a_subchart_and_refuses_uncoordinated_replicas(kubectl: Kubectl, tmp_path: Any) -> None:
    """Inside an umbrella chart (which may set globals), and never several operators without peering."""
    umbrella = tmp_path / "platform"
    (umbrella / "charts").mkdir(parents=True)
    # the dependency switched by a condition, as umbrella charts do; pull secrets and labels shared
    (umbrella / "Chart.yaml").write_text(
        "apiVersion: v2\nname: platform\nversion: 0.1.0\ndependencies:\n"
        "  - {name: tally-operator, version: '*', condition: tally-operator.enabled}\n")
    (umbrella / "values.yaml").write_text("global:\n  imageRegistry: registry.example\n"
                                          "  imagePullSecrets: [platform-pull, {name: other-pull}]\n"
                                          "tally-operator:\n  enabled: true\n  replicaCount: 2\n"
                                          "  imagePullSecrets: [{name: own-pull}]\n"
                                          "  commonLabels: {team: platform}\n")
    shutil.copytree(CHART, umbrella / "charts" / "tally-operator")
    nested = subprocess.run(["helm", "template", "p", str(umbrella)], env=kubectl.env, capture_output=True, text=True)
    assert nested.returncode == 0, nested.stderr
    assert "replicas: 2" in nested.stdout
    objects = [o for o in yaml.safe_load_all(nested.stdout) if o]
    assert objects and all(o["metadata"]["labels"]["team"] == "platform" for o in objects)
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [
        {"name": "own-pull"}, {"name": "platform-pull"}, {"name": "other-pull"}]
    assert "team" not in deployment["spec"]["selector"]["matchLabels"]  # selectors never change
    off = subprocess.run(["helm", "template", "p", str(umbrella), "--set", "tally-operator.enabled=false"],
                         env=kubectl.env, capture_output=True, text=True)
    assert off.returncode == 0 and "kind: Deployment" not in off.stdout, off.stderr
    alone = subprocess.run(["helm", "template", "t", str(CHART), "--set", "replicaCount=2", "--set",
                            "peering.enabled=false"], env=kubectl.env, capture_output=True, text=True)
    assert alone.returncode != 0 and "needs peering.enabled" in alone.stderr


@pytest.mark.parametrize(("name_length", "spec", "refused_over"), [
    pytest.param(59, {"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}, 58, id="scale to zero: <name>-pods"),
    pytest.param(60, {"routing": {"inferencePool": {}}}, 59, id="routed, the operator's picker: <name>-epp"),
])
def test_the_api_server_refuses_a_name_its_children_cannot_carry(
        operator: ChartOperator, kube: Kubectl, name_length: int, spec: dict[str, Any], refused_over: int) -> None:
    def dry_run(length: int) -> subprocess.CompletedProcess[str]:
        manifest = example(**spec)
        manifest["metadata"]["name"] = "s" * length
        return subprocess.run(["kubectl", "-n", str(kube.namespace), "apply", "--dry-run=server", "-f", "-"],
                              input=json.dumps(manifest), env=kube.env, capture_output=True, text=True, timeout=60)

    refused = dry_run(name_length)
    assert refused.returncode != 0 and f"at most {refused_over} characters" in refused.stderr, refused.stderr
    fits = dry_run(refused_over)
    assert fits.returncode == 0, fits.stderr


def test_namespace_users_get_completion_services_through_the_standard_roles(
        operator: ChartOperator, kubectl: Kubectl, namespace: str) -> None:
    """The chart's ClusterRoles aggregate into view, edit and admin: a RoleBinding to edit is all a team needs."""
    kube = kubectl.in_namespace(namespace)
    kube("create", "serviceaccount", "writer")
    kube("create", "serviceaccount", "reader")
    kube("create", "rolebinding", "writer", "--clusterrole=edit", f"--serviceaccount={namespace}:writer")
    kube("create", "rolebinding", "reader", "--clusterrole=view", f"--serviceaccount={namespace}:reader")

    def can(who: str, verb: str) -> str:
        return kube("auth", "can-i", verb, "completionservices.serving.tally.dev",
                    f"--as=system:serviceaccount:{namespace}:{who}", check=False).strip()

    eventually(lambda: can("writer", "create") == "yes" and can("reader", "list") == "yes", 60, interval=1,
               what="edit and view aggregating the chart's rules")
    assert can("reader", "create") == "no" and can("writer", "delete") == "yes"
    # a service's books (its UsageShards) are read by both and written by the operator alone
    def on_shards(who: str, verb: str) -> str:
        return kube("auth", "can-i", verb, "usageshards.serving.tally.dev",
                    f"--as=system:serviceaccount:{namespace}:{who}", check=False).strip()

    assert on_shards("reader", "list") == on_shards("writer", "get") == "yes"
    assert {on_shards("writer", verb) for verb in ("create", "update", "patch", "delete")} == {"no"}


def test_chart_watching_namespaces_grants_roles_only_there(operator: ChartOperator, kubectl: Kubectl,
                                                           namespace: str) -> None:
    """A namespaced install: RBAC and peering in the watched namespace only. (The operator fixture installed
    the chart, so kopf's peering CRDs exist for the server's dry run.)"""
    rendered = subprocess.run(["helm", "template", "t", str(CHART), "--set", f"watchNamespaces={{{namespace}}}",
                               "--set", "fullnameOverride=tally-team-a", "--set", "nameOverride=tally"],
                              check=True, env=kubectl.env, capture_output=True, text=True).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o]
    kinds = {(o["kind"], o["metadata"].get("namespace")) for o in objects}
    assert {("Role", namespace), ("RoleBinding", namespace), ("KopfPeering", namespace)} <= kinds
    assert ("ClusterKopfPeering", None) not in kinds
    cluster_role = next(o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "tally-team-a")
    # cluster-wide only what is cluster-scoped: CRDs, and the platform's Budgets (read; their status written)
    assert [r["resources"] for r in cluster_role["rules"]] == [["customresourcedefinitions"], ["budgets"],
                                                               ["budgets/status"], ["budgetshards"]]
    assert "create" not in cluster_role["rules"][1]["verbs"] and "delete" not in cluster_role["rules"][1]["verbs"]
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "CustomResourceDefinition"} == \
        {"completionservices.serving.tally.dev", "budgets.serving.tally.dev", "budgetshards.serving.tally.dev",
         "usageshards.serving.tally.dev"}  # cluster-scoped whatever it watches
    names = {o["metadata"]["name"] for o in objects
             if o["kind"] not in {"Service", "Secret", "ClusterRole", "CustomResourceDefinition"}}
    assert names == {"tally-team-a", "tally-team-a-reach"}  # the operator's reach policy beside the others
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"} == {"tally-team-a-signing"}
    assert all(o["metadata"]["labels"]["app.kubernetes.io/name"] == "tally" for o in objects)
    env = next(c for c in objects if c["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "TALLY_OPERATOR_PEERING_CLUSTERWIDE", "value": "false"} in env
    server = subprocess.run(["kubectl", "apply", "--dry-run=server", "-f", "-"], input=rendered, text=True,
                            env=kubectl.env, capture_output=True)
    assert server.returncode == 0, server.stderr


def test_example_becomes_ready_with_gpu_pods(operator: ChartOperator, kube: Kubectl, namespace: str) -> None:
    kube.apply(example())
    ready = eventually(lambda: (r := condition(kube, "Ready")).get("status") == "True" and r, 90, what="Ready=True")
    assert ready["reason"] == "AllReplicasReady"
    cs = kube.json("get", "completionservice", "smollm")
    assert cs["status"]["readyReplicas"] == 2 and cs["status"]["observedGeneration"] == cs["metadata"]["generation"]
    assert cs["status"]["desiredReplicas"] == 2
    columns = kube("get", "completionservice", "smollm").split("\n")[:2]
    assert columns[0].split()[:4] == ["NAME", "READY", "PODS", "DESIRED"]
    assert columns[1].split()[1:4] == ["True", "2", "2"]
    assert cs["status"]["endpoint"] == f"http://smollm.{namespace}.svc.cluster.local:8000/v1"
    dep = deployment(kube)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert dep["metadata"]["ownerReferences"][0]["uid"] == cs["metadata"]["uid"]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert kube.json("get", "service", "smollm")["spec"]["ports"][0]["port"] == 8000
    assert kube.json("get", "pdb", "smollm")["spec"]["maxUnavailable"] == 1
    events = kube.json("get", "events", "--field-selector", "involvedObject.kind=CompletionService")["items"]
    assert any(e["reason"] == "ReadyTrue" for e in events)


def test_scale_subresource(operator: ChartOperator, kube: Kubectl) -> None:
    kube.apply(example())
    eventually(lambda: condition(kube, "Ready").get("status") == "True", 90, what="Ready")
    kube("scale", "completionservice", "smollm", "--replicas=1")
    eventually(lambda: deployment(kube)["spec"]["replicas"] == 1, 30, what="Deployment scaled")
    eventually(lambda: kube("get", "pdb", "smollm", check=False) == "", 30, what="PDB removed at one replica")
    status = eventually(lambda: (s := kube.json("get", "completionservice", "smollm")["status"])["replicas"] == 1
                        and s, 60, what="status.replicas == 1")
    assert status["selector"] == "serving.tally.dev/completionservice=smollm"


def test_spec_change_rolls_out(operator: ChartOperator, kube: Kubectl) -> None:
    kube.apply(example())
    eventually(lambda: condition(kube, "Ready").get("status") == "True", 90, what="Ready")
    kube("patch", "completionservice", "smollm", "--type=merge", "-p", '{"spec":{"engine":{"contextLength":1024}}}')

    def rolled() -> bool:
        args = deployment(kube)["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index("--context-length") + 1] == "1024"

    eventually(rolled, 30, what="new args in the pod template")
    def rolled_out_and_ready() -> dict[str, Any] | None:  # one read: generation, condition and counts agree
        cs = kube.json("get", "completionservice", "smollm")
        status = cs.get("status") or {}
        ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
        progressing = next((c for c in status.get("conditions") or [] if c["type"] == "Progressing"), {})
        current = status.get("observedGeneration") == cs["metadata"]["generation"]
        # Ready stays True at full capacity while the rollout goes on: its end is Progressing=False
        done = ready.get("status") == "True" and progressing.get("status") == "False"
        return cs if current and done else None

    cs = eventually(rolled_out_and_ready, 90, what="rolled out and Ready")
    assert cs["status"]["updatedReplicas"] == 2


def test_more_gpus_than_any_node_is_unschedulable(operator: ChartOperator, kube: Kubectl) -> None:
    kube.apply(example(replicas=1, resources={"gpus": 16, "cpu": "1", "memory": "1Gi"}))
    progressing = eventually(lambda: (p := condition(kube, "Progressing")).get("reason") == "Unschedulable" and p,
                             60, what="Progressing/Unschedulable")
    assert progressing["status"] == "True" and "nvidia.com/gpu" in progressing["message"]
    assert condition(kube, "Ready")["status"] == "False"


@pytest.mark.parametrize(("spec", "reason"), [
    pytest.param({"engine": {"kind": "sglang", "tensorParallelSize": 2}, "model": {"name": "m", "path": "/m"},
                  "resources": {"gpus": 3}}, "GPUsNotDivisible", id="gpus-vs-tp"),
])
def test_invalid_spec_is_ready_false_with_event(operator: ChartOperator, kube: Kubectl, spec: dict[str, Any],
                                                reason: str) -> None:
    kube.apply(example(**spec))
    ready = eventually(lambda: (r := condition(kube, "Ready")).get("reason") == reason and r, 60,
                       what=f"Ready=False/{reason}")
    assert ready["status"] == "False"
    events = eventually(lambda: [e for e in kube.json("get", "events")["items"]
                                 if e["type"] == "Warning" and reason in e["message"]], 30, what="Warning event")
    assert events
    assert kube("get", "deployment", "smollm", check=False) == ""


def test_schema_rules_reject_bad_specs(operator: ChartOperator, kube: Kubectl) -> None:
    bad = example(engine={"kind": "sglang"}, resources={"gpus": 0})
    done = subprocess.run(["kubectl", "-n", kube.namespace or "", "apply", "-f", "-"], input=json.dumps(bad),
                          text=True, capture_output=True, env=kube.env)
    assert done.returncode != 0 and "at least one GPU" in done.stderr
    owned = example(engine={"kind": "cpu", "args": ["--port=9"]})  # an owned argument is no allowed option
    done = subprocess.run(["kubectl", "-n", kube.namespace or "", "apply", "-f", "-"], input=json.dumps(owned),
                          text=True, capture_output=True, env=kube.env)
    assert done.returncode != 0 and "one allowed SGLang option" in done.stderr


def test_deleting_the_resource_collects_children(operator: ChartOperator, kube: Kubectl) -> None:
    kube.apply(example())
    eventually(lambda: kube("get", "deployment", "smollm", check=False), 60, what="Deployment")
    kube("delete", "completionservice", "smollm")
    eventually(lambda: not kube.json("get", "deployments,services,pdb,pods")["items"], 60,
               what="children garbage-collected")


def test_manual_edits_to_owned_fields_are_reverted(operator: ChartOperator, kube: Kubectl) -> None:
    kube.apply(example())
    eventually(lambda: condition(kube, "Ready").get("status") == "True", 90, what="Ready")
    kube("patch", "deployment", "smollm", "--type=merge", "-p", '{"spec":{"replicas":5}}')
    eventually(lambda: deployment(kube)["spec"]["replicas"] == 2, 30, what="replicas reverted to the spec")


def test_restart_creates_no_duplicates_and_keeps_status(operator: ChartOperator, kube: Kubectl) -> None:
    kube.apply(example())
    eventually(lambda: condition(kube, "Ready").get("status") == "True", 90, what="Ready")
    before_uid = deployment(kube)["metadata"]["uid"]
    before_ready = condition(kube, "Ready")
    operator.restart()
    kube("annotate", "completionservice", "smollm", "touched=yes", "--overwrite")
    eventually(lambda: condition(kube, "Ready").get("status") == "True", 30, what="still Ready")
    assert deployment(kube)["metadata"]["uid"] == before_uid
    assert len(kube.json("get", "deployments")["items"]) == 1
    assert condition(kube, "Ready")["lastTransitionTime"] == before_ready["lastTransitionTime"]


def test_operator_log_has_no_tracebacks_from_our_code(operator: ChartOperator) -> None:
    """Our handlers never crash. (kopf itself logs an internal assertion while peering pauses; not ours.)"""
    blocks = operator.logs().split("Traceback (most recent call last):")[1:]
    ours = [b for b in blocks if "tally_operator" in b.split("\n20")[0]]
    assert not ours, ours[0][:3000]


@pytest.mark.parametrize("example_file", ["smollm-cpu.yaml", "llama-sglang.yaml"])
def test_builders_pass_the_servers_schema_validation(kube: Kubectl, namespace: str, example_file: str) -> None:
    """Desired objects are valid for this Kubernetes version (server-side dry run, strict field validation)."""
    from tally_operator.desired import desired_deployment, desired_pdb, desired_service
    from tally_operator.settings import OperatorSettings
    from tally_operator.spec import parse_spec

    raw = yaml.safe_load((ROOT / "crds" / "examples" / example_file).read_text())
    meta = {"name": raw["metadata"]["name"], "namespace": namespace, "uid": "00000000-0000-0000-0000-000000000001"}
    spec = parse_spec(raw["spec"])
    for obj in (desired_deployment(meta, spec, OperatorSettings()), desired_service(meta), desired_pdb(meta, spec)):
        assert obj is not None
        done = subprocess.run(["kubectl", "apply", "--dry-run=server", "--validate=strict", "-f", "-"],
                              input=json.dumps(obj), text=True, capture_output=True, env=kube.env)
        assert done.returncode == 0, done.stderr

"""What a CompletionService may ask for: refused by default beyond a plain service, widened by settings."""

from __future__ import annotations

from typing import Any

import pytest

from tally_operator.desired import desired_deployment, desired_network_policy
from tally_operator.policy import check_policy
from tally_operator.settings import OperatorSettings
from tally_operator.spec import SpecError, parse_spec

BASE: dict[str, Any] = {"model": {"name": "m", "path": "/models/m"}, "engine": {"kind": "sglang"}}
DEFAULTS = OperatorSettings()


def spec(**changes: Any) -> dict[str, Any]:
    raw = {**BASE, **changes}
    if "engine" in changes:
        raw["engine"] = {**BASE["engine"], **changes["engine"]}
    return raw


@pytest.mark.parametrize(("raw", "reason"), [
    pytest.param(spec(model={"name": "m", "path": "/m", "volume": {"hostPath": {"path": "/etc"}}}), "ForbiddenVolume",
                 id="host-path"),
    pytest.param(spec(model={"name": "m", "path": "/m", "volume": {"secret": {"secretName": "s"}}}), "ForbiddenVolume",
                 id="secret-volume"),
    pytest.param(spec(model={"name": "m", "path": "/m", "volume": {"projected": {"sources": []}}}),
                 "ForbiddenVolume", id="projected-token"),
    pytest.param(spec(engine={"image": "evil/runtime:1"}), "ForbiddenImage", id="foreign-image"),
    pytest.param(spec(scheduling={"tolerations": [{"operator": "Exists"}]}), "ForbiddenToleration",
                 id="tolerate-everything"),
    pytest.param(spec(scheduling={"priorityClassName": "system-node-critical"}), "ForbiddenPriorityClassName",
                 id="priority-class"),
    pytest.param(spec(scheduling={"runtimeClassName": "kata"}), "ForbiddenRuntimeClassName", id="runtime-class"),
    pytest.param(spec(resources={"gpus": 0, "gpuResourceName": "node-role.kubernetes.io/control-plane"},
                      scheduling={"tolerations": [{"key": "node-role.kubernetes.io/control-plane",
                                                   "operator": "Exists"}]}),
                 "ForbiddenGpuResourceName", id="control-plane-taint-as-the-gpu-resource"),
    pytest.param(spec(model={"name": "m", "path": "/m", "volume": {"image": {"reference": "any/image:1"}}}),
                 "ForbiddenVolume", id="image-volume-off-by-default"),
    # each of these ran the author's code in the runtime's process or container (bare names resolved on PATH,
    # OpenSSL's config loading an engine .so, Triton's compiler and caches on a GPU node)
    pytest.param(spec(engine={"env": [{"name": "OPENSSL_CONF", "value": "/models/openssl.cnf"}]}), "ForbiddenEnv",
                 id="openssl-conf"),
    pytest.param(spec(engine={"env": [{"name": "CC", "value": "/models/cc"}]}), "ForbiddenEnv", id="triton-cc"),
    pytest.param(spec(engine={"env": [{"name": "TRITON_CACHE_DIR", "value": "/models/cache"}]}), "ForbiddenEnv",
                 id="triton-cache"),
    pytest.param(spec(engine={"env": [{"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/models"}]}), "ForbiddenEnv",
                 id="inductor-cache"),
    pytest.param(spec(engine={"env": [{"name": "NCCL_NET_PLUGIN", "value": "/models/libnet.so"}]}), "ForbiddenEnv",
                 id="nccl-plugin"),
])
def test_refused_by_default(raw: dict[str, Any], reason: str) -> None:
    with pytest.raises(SpecError) as refused:
        check_policy(parse_spec(raw), DEFAULTS)
    assert refused.value.reason == reason


@pytest.mark.parametrize(("raw", "reason"), [
    pytest.param(spec(engine={"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}),
                 "ForbiddenEnv", id="secret-env"),
    pytest.param(spec(engine={"env": [{"name": "TALLY_API_KEYS_FILE", "value": "/dev/null"}]}), "ForbiddenEnv",
                 id="runtime-setting"),
    pytest.param(spec(engine={"env": [{"name": "PYTHONPATH", "value": "/models"}]}), "ForbiddenEnv",
                 id="code-loading"),
    pytest.param(spec(engine={"args": ["--mem-frac=0.99"]}), "OwnedEngineArgument", id="abbreviated-owned"),
    pytest.param(spec(engine={"env": [{"name": "POD_NAME", "value": "someone-else"}]}), "ForbiddenEnv",
                 id="reserved-env-picks-the-records-source"),
    pytest.param(spec(engine={"env": [{"name": "PATH", "value": "/models:/usr/bin"}]}), "ForbiddenEnv",
                 id="path-even-if-a-platform-allows-every-name"),
    pytest.param(spec(auth={"apiKeysSecret": {"name": "db-password"}}), "ForbiddenSecret",
                 id="a-secret-that-did-not-opt-in"),
    pytest.param(spec(engine={"args": ["--trust-remote"]}), "OwnedEngineArgument", id="abbreviated-flag"),
    pytest.param(spec(engine={"args": [" --trust-remote"]}), "OwnedEngineArgument", id="abbreviated-after-space"),
    pytest.param(spec(engine={"args": ["--chat-template=x --trust-remote"]}), "ForbiddenEngineArgument",
                 id="hidden-in-a-value"),
    pytest.param(spec(engine={"args": ["--load-format=dummy"]}), "ForbiddenEngineArgument", id="not-allowed"),
])
def test_refused_whatever_the_settings(raw: dict[str, Any], reason: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec(raw)
    assert refused.value.reason == reason


def test_what_a_plain_service_needs_is_allowed_and_settings_widen_it() -> None:
    plain = spec(model={"name": "m", "path": "/m", "volume": {"persistentVolumeClaim": {"claimName": "weights"}}},
                 engine={"env": [{"name": "NCCL_DEBUG", "value": "INFO"}], "args": ["--stream-interval=2"]},
                 scheduling={"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]})
    check_policy(parse_spec(plain), DEFAULTS)
    wide = OperatorSettings(allowed_images=("registry.example/tally/*",), allowed_toleration_keys=("pool",),
                            allowed_volume_types=("hostPath",), allowed_priority_classes=("gpu-high",))
    check_policy(parse_spec(spec(engine={"image": "registry.example/tally/runtime:2"},
                                 scheduling={"tolerations": [{"key": "pool"}], "priorityClassName": "gpu-high"},
                                 model={"name": "m", "path": "/m", "volume": {"hostPath": {"path": "/w"}}})), wide)


def test_a_platform_may_widen_the_environment_by_name_or_prefix() -> None:
    raw = spec(engine={"env": [{"name": "SGLANG_ENABLE_TORCH_COMPILE", "value": "1"}]})
    with pytest.raises(SpecError):
        check_policy(parse_spec(raw), DEFAULTS)
    check_policy(parse_spec(raw), OperatorSettings(allowed_env_names=("SGLANG_ENABLE_*",)))


def test_the_chart_and_the_operator_default_to_the_same_environment_names() -> None:
    from pathlib import Path

    import yaml

    values = yaml.safe_load((Path(__file__).resolve().parents[3] / "charts" / "tally-operator" / "values.yaml")
                            .read_text())
    assert tuple(values["policy"]["allowedEnvNames"]) == DEFAULTS.allowed_env_names


def test_every_container_of_the_runtime_image_runs_it_by_its_absolute_path() -> None:
    raw = spec(engine={"kind": "cpu"}, model={"name": "m"}, autoscaling={"minReplicas": 0, "maxReplicas": 2})
    parsed = parse_spec(raw)
    meta = {"name": "s", "namespace": "n", "uid": "u"}
    runtime = desired_deployment(meta, parsed, DEFAULTS)["spec"]["template"]["spec"]["containers"][0]
    assert runtime["command"] == ["/opt/tally/bin/tally-runtime"] and runtime["args"][0] == "serve"


@pytest.mark.parametrize("source", [
    pytest.param({"configMap": {"name": "weights", "defaultMode": 0o755}}, id="configMap-0755"),
    pytest.param({"configMap": {"name": "weights", "items": [{"key": "run", "path": "tally-runtime", "mode": 0o777}]}},
                 id="configMap-item-0777"),
])
def test_the_model_volume_never_holds_an_executable(source: dict[str, Any]) -> None:
    raw = spec(model={"name": "m", "path": "/models/m", "volume": source})
    pod = desired_deployment({"name": "s", "namespace": "n", "uid": "u"}, parse_spec(raw), DEFAULTS)["spec"][
        "template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "models")["configMap"]
    assert volume["defaultMode"] == 0o444 and volume["name"] == "weights"
    assert all(item["mode"] == 0o444 for item in volume.get("items", []))


def test_the_keys_secret_is_mounted_read_only_and_the_runtime_told_where() -> None:
    raw = spec(auth={"apiKeysSecret": {"name": "tally-api-keys-team", "key": "keys"}, "trustTenantHeader": True})
    dep = desired_deployment({"name": "s", "namespace": "n", "uid": "u"}, parse_spec(raw), DEFAULTS)
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert {"name": "api-keys", "mountPath": "/etc/tally/auth", "readOnly": True} in container["volumeMounts"]
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume["secret"] == {"secretName": "tally-api-keys-team", "defaultMode": 0o400,
                                "items": [{"key": "keys", "path": "api-keys"}]}
    args = container["args"]
    assert args[args.index("--api-keys-file") + 1] == "/etc/tally/auth/api-keys" and "--trust-tenant-header" in args


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_the_network_policies_cover_the_activator_and_the_picker_too() -> None:
    """A client the activator (or picker) admits must be one the service's policy admits: the activator relays to
    the pods (with apiSameNamespaceOnly, any pod reached the pods through it)."""
    from tally_operator.desired import desired_activator
    from tally_operator.desired_pool import desired_picker

    meta = {"name": "s", "namespace": "n", "uid": "u"}
    settings = OperatorSettings(network_policy=True, namespace="tally-system", network_policy_api_same_namespace=True)
    raw = spec(engine={"kind": "cpu"}, model={"name": "m"}, autoscaling={"minReplicas": 0, "maxReplicas": 2},
               routing={"inferencePool": {}})
    parsed = parse_spec(raw)
    policy = desired_network_policy(meta, settings)
    activator = desired_activator(meta, parsed, settings)
    assert policy is not None and activator is not None
    runtime_labels = desired_deployment(meta, parsed, settings)["spec"]["template"]["metadata"]["labels"]
    activator_labels = activator["spec"]["template"]["metadata"]["labels"]
    assert matches(policy["spec"]["podSelector"], runtime_labels)
    assert matches(policy["spec"]["podSelector"], activator_labels)
    picker = {o["kind"]: o for o in desired_picker(meta, parsed, settings)}
    picker_labels = picker["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert not matches(policy["spec"]["podSelector"], picker_labels)
    picker_policy = picker["NetworkPolicy"]
    assert matches(picker_policy["spec"]["podSelector"], picker_labels)
    metrics, serving = picker_policy["spec"]["ingress"]
    assert serving["from"] == [{"podSelector": {}}] and {p["port"] for p in serving["ports"]} == {9002, 9003}
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "tally-system"}
    assert "NetworkPolicy" not in {o["kind"] for o in desired_picker(meta, parsed, DEFAULTS)}


def test_the_network_policy_opens_metrics_to_the_operator_only() -> None:
    assert desired_network_policy({"name": "s", "namespace": "n", "uid": "u"}, DEFAULTS) is None
    policy = desired_network_policy({"name": "s", "namespace": "n", "uid": "u"},
                                    OperatorSettings(network_policy=True, namespace="tally-system"))
    assert policy is not None
    metrics, api = policy["spec"]["ingress"]
    assert metrics["ports"] == [{"port": 8001, "protocol": "TCP"}]
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "tally-system"}
    assert api["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert "from" not in api  # every client by default


def test_the_network_policy_admits_a_monitoring_namespace_and_can_close_the_api_to_other_namespaces() -> None:
    policy = desired_network_policy({"name": "s", "namespace": "n", "uid": "u"}, OperatorSettings(
        network_policy=True, namespace="tally-system", monitoring_namespace="monitoring",
        network_policy_api_same_namespace=True))
    assert policy is not None
    metrics, api = policy["spec"]["ingress"]
    assert [peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for peer in metrics["from"]] == \
        ["tally-system", "monitoring"]
    assert "podSelector" not in metrics["from"][1]  # every pod of the monitoring namespace
    assert api["from"] == [{"podSelector": {}}]


def test_runtime_pods_get_the_operators_public_key_and_nothing_when_it_has_none() -> None:
    meta = {"name": "s", "namespace": "n", "uid": "u"}
    spec = parse_spec({"model": {"name": "m"}, "engine": {"kind": "cpu"}})

    def env(settings: OperatorSettings) -> dict[str, str]:
        container = desired_deployment(meta, spec, settings)["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value", "") for e in container["env"]}

    assert env(OperatorSettings(final_read_key="cHVibGlj"))["TALLY_FINAL_READ_KEY"] == "cHVibGlj"
    assert "TALLY_FINAL_READ_KEY" not in env(OperatorSettings())


def test_runtime_pods_pull_with_the_secrets_the_chart_names() -> None:
    meta = {"name": "s", "namespace": "n", "uid": "u"}
    spec = parse_spec({"model": {"name": "m"}, "engine": {"kind": "cpu"}})
    pod = desired_deployment(meta, spec, OperatorSettings(runtime_image_pull_secrets=("registry", "mirror")))
    assert pod["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "registry"}, {"name": "mirror"}]
    assert "imagePullSecrets" not in desired_deployment(meta, spec, OperatorSettings())["spec"]["template"]["spec"]
    settings = OperatorSettings.from_env({"TALLY_OPERATOR_RUNTIME_IMAGE_PULL_SECRETS": "registry, mirror"})
    assert settings.runtime_image_pull_secrets == ("registry", "mirror")
    args = pod["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--service-namespace") + 1] == "n" and args[args.index("--service-name") + 1] == "s"


def test_record_delivery_reaches_the_pods_with_a_token_from_a_secret_that_opted_in() -> None:
    meta = {"name": "s", "namespace": "n", "uid": "u"}
    spec = parse_spec({"model": {"name": "m"}, "engine": {"kind": "cpu"}, "usageRecords": {"delivery": {
        "url": "https://meter.example/api/v1/events", "tokenSecret": {"name": "tally-usage-delivery-meter"}}}})
    pod = desired_deployment(meta, spec, OperatorSettings(allow_service_delivery=True))["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--usage-records-url") + 1] == "https://meter.example/api/v1/events"
    assert args[args.index("--usage-records-token-file") + 1] == "/etc/tally/delivery/token"
    assert "--usage-source=/namespaces/n/completionservices/s/pods/$(POD_NAME)" in args
    volume = next(v for v in pod["volumes"] if v["name"] == "delivery")
    assert volume["secret"] == {"secretName": "tally-usage-delivery-meter", "defaultMode": 0o400,
                                "items": [{"key": "token", "path": "token"}]}
    for bad, why in (({"url": "https://m", "tokenSecret": {"name": "db-password"}}, "tally-usage-delivery"),
                     ({"url": "file:///etc/passwd"}, "http")):
        with pytest.raises(SpecError, match=why):
            parse_spec({"model": {"name": "m"}, "engine": {"kind": "cpu"}, "usageRecords": {"delivery": bad}})

"""Pure builders: spec -> Deployment / Service / PDB, and spec checks."""

from __future__ import annotations

from typing import Any

import pytest

from tally_operator.desired import desired_deployment, desired_pdb, desired_service, runtime_args
from tally_operator.settings import OperatorSettings
from tally_operator.spec import SpecError, parse_spec

META = {"name": "llama", "namespace": "team-a", "uid": "u-1"}


SGLANG = {"model": {"name": "llama-8b", "path": "/models/llama"}, "engine": {"kind": "sglang", "tensorParallelSize": 2,
          "args": ["--stream-interval=2"]}, "replicas": 3, "resources": {"gpus": 4}}


def container(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(desired_deployment(META, parse_spec(raw), OperatorSettings())["spec"]["template"]["spec"]
                ["containers"][0])


def test_deployment_has_gpu_limits_probes_shm_and_safe_rollout() -> None:
    dep = desired_deployment(META, parse_spec(SGLANG), OperatorSettings(runtime_image="rt:1"))
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "rt:1" and c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 1800
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert dep["spec"]["selector"] == {"matchLabels": {"serving.tally.dev/completionservice": "llama"}}
    assert dep["metadata"]["ownerReferences"][0] == {"apiVersion": "serving.tally.dev/v1alpha1",
                                                     "kind": "CompletionService", "name": "llama", "uid": "u-1",
                                                     "controller": True, "blockOwnerDeletion": True}
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True  # writable: /tmp, /dev/shm, the ledger
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/dev/shm", "/var/lib/tally"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_runtime_args_carry_the_sglang_settings() -> None:
    args = runtime_args(parse_spec(SGLANG), META)
    assert args[:9] == ["serve", "--host", "::", "--port", "8000", "--metrics-port", "8001", "--engine", "sglang"]
    pairs = dict(zip(args[1::2], args[2::2], strict=False))
    assert pairs["--tensor-parallel-size"] == "2" and pairs["--data-parallel-size"] == "2"
    assert pairs["--model-path"] == "/models/llama" and args[-1] == "--engine-arg=--stream-interval=2"


def test_cpu_engine_without_gpus_has_no_gpu_limit_or_toleration() -> None:
    c = container({"model": {"name": "m"}, "engine": {"kind": "cpu"}, "resources": {"gpus": 0}})
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert "--model-path" not in c["args"]


def test_service_and_pdb() -> None:
    spec = parse_spec(SGLANG)
    svc = desired_service(META)
    assert svc["spec"]["ports"][0]["port"] == 8000 and svc["spec"]["type"] == "ClusterIP"
    pdb = desired_pdb(META, spec)
    assert pdb is not None and pdb["spec"]["maxUnavailable"] == 1
    assert desired_pdb(META, parse_spec({**SGLANG, "replicas": 1})) is None


@pytest.mark.parametrize(("raw", "reason"), [
    pytest.param({**SGLANG, "engine": {"kind": "sglang", "args": ["--port=9"]}}, "OwnedEngineArgument", id="owned"),
    pytest.param({**SGLANG, "resources": {"gpus": 3}}, "GPUsNotDivisible", id="tp"),
    pytest.param({"model": {"name": "m"}, "engine": {"kind": "sglang"}}, "InvalidSpec", id="sglang-needs-path"),
    pytest.param({"model": {}}, "InvalidSpec", id="no-name"),
    pytest.param({**SGLANG, "autoscaling": {"maxReplicas": 4, "scaleDownDelaySeconds": 86_400}}, "InvalidSpec",
                 id="scaling-delay-beyond-an-hour"),
    pytest.param({**SGLANG, "autoscaling": {"maxReplicas": 4, "minReplicas": -1}}, "InvalidSpec",
                 id="negative-min"),
    pytest.param({**SGLANG, "autoscaling": {"maxReplicas": 4, "minReplicas": 0, "scaleToZero": {"holdSeconds": 0}}},
                 "InvalidSpec", id="hold-nothing"),
    pytest.param({**SGLANG, "autoscaling": {"maxReplicas": 4, "minReplicas": 0,
                                            "scaleToZero": {"maxHeldRequests": 10**6}}}, "InvalidSpec",
                 id="unbounded-queue"),
])
def test_invalid_specs(raw: dict[str, Any], reason: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)
    assert caught.value.reason == reason


def test_pods_keep_their_counters_on_a_volume_and_get_time_to_drain() -> None:
    raw = {**SGLANG, "drainSeconds": 120, "usageHealth": {"scrapeIntervalSeconds": 10}}
    pod = desired_deployment(META, parse_spec(raw), OperatorSettings())["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert {"name": "ledger", "emptyDir": {"sizeLimit": "16Mi"}} in pod["volumes"]
    assert {"name": "ledger", "mountPath": "/var/lib/tally"} in c["volumeMounts"]
    args = c["args"]
    assert args[args.index("--journal-path") + 1] == "/var/lib/tally/usage.json"
    assert args[args.index("--drain-seconds") + 1] == "120"
    final_read = int(args[args.index("--final-read-seconds") + 1])
    assert final_read >= 2 * 10  # the operator gets two scrape rounds to read the final counters
    assert pod["terminationGracePeriodSeconds"] > 120 + final_read  # the kubelet never kills a drain short


@pytest.mark.parametrize("flag", ["--stream-output", "--incremental-streaming-output"])
def test_the_streaming_switch_in_engine_args_is_accepted_as_the_runtime_accepts_it(flag: str) -> None:
    """One rule on both sides: Tally always turns incremental streaming on, so the flag is redundant."""
    spec = parse_spec({**SGLANG, "engine": {"kind": "sglang", "args": [flag, "--stream-interval=2"]}})
    args = runtime_args(spec, META)
    assert args[-2:] == [f"--engine-arg={flag}", "--engine-arg=--stream-interval=2"]


@pytest.mark.parametrize("item", [
    "--chat-template=x --trust-remote --tokenizer-pa evil-org/evil",  # one item, read as three options once split
    " --trust-remote",  # whitespace before an abbreviation
    "--stream-interval 2",  # two options' worth of text in one item
    "--tokenizer-path=evil-org/evil",
    "--log-requests",  # prompts into the logs
    "--speculative-draft-model-path=evil-org/evil",
    "--disable-radix-cache=true",  # a switch given a value
    "--stream-interval=/etc/passwd",  # a path as a value
    "--stream-interval=",
])
def test_engine_args_outside_the_allow_list_are_refused(item: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec({**SGLANG, "engine": {"kind": "sglang", "args": ["--stream-interval=2", item]}})
    assert refused.value.reason in {"ForbiddenEngineArgument", "OwnedEngineArgument"}


def test_a_delivering_pods_volume_is_sized_from_its_spool_and_the_platform_configures_the_receiver() -> None:
    """The spool held 64 MiB by default on a 16 Mi emptyDir: a receiver down for half an hour got every delivering
    pod evicted (no drain, no final read, the spool deleted with it). The spool's bound is now passed, and the
    volume is the spool plus room; the CAs and the proxy are the platform's settings, not the spec's."""
    raw = {"model": {"name": "m"}, "engine": {"kind": "cpu"},
           "usageRecords": {"delivery": {"url": "https://meter.example/api/v1/events"}}}
    settings = OperatorSettings(records_spool_bytes=64 << 20, records_ca="-----BEGIN CERTIFICATE-----",
                                records_proxy="http://egress:3128", allow_service_delivery=True)
    pod = desired_deployment(META, parse_spec(raw), settings)["spec"]["template"]["spec"]
    ledger = next(v for v in pod["volumes"] if v["name"] == "ledger")
    args = pod["containers"][0]["args"]
    assert "--usage-records-spool-bytes=67108864" in args and "--usage-records-proxy=http://egress:3128" in args
    assert ledger["emptyDir"]["sizeLimit"] == "82Mi"  # 16 for the journal, 64 of spool, 2 for its segments
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["TALLY_USAGE_RECORDS_CA"] == "-----BEGIN CERTIFICATE-----"
    plain = desired_deployment(META, parse_spec({"model": {"name": "m"}, "engine": {"kind": "cpu"}}), settings)[
        "spec"]["template"]["spec"]
    assert next(v for v in plain["volumes"] if v["name"] == "ledger")["emptyDir"]["sizeLimit"] == "16Mi"
    assert "TALLY_USAGE_RECORDS_CA" not in {e["name"] for e in plain["containers"][0]["env"]}


def test_with_the_platforms_billing_system_the_pods_keep_their_records_for_the_operator() -> None:
    """The platform's delivery: every pod keeps its records (CloudEvents with its own source) for the operator to
    collect; no token, URL, CA or proxy of the billing system reaches a serving namespace. A service's own
    delivery applies only where the platform allows it, and is refused where it does not."""
    from tally_operator.policy import check_policy

    platform = OperatorSettings(records_url="https://meter.example/api/v1/events", records_ca="PEM",
                                allow_service_delivery=False)
    plain = parse_spec({"model": {"name": "m"}, "engine": {"kind": "cpu"}})
    pod = desired_deployment(META, plain, platform)["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--usage-records-pull" in args and not any(a.startswith("--usage-records-url") for a in args)
    assert "--usage-source=/namespaces/team-a/completionservices/llama/pods/$(POD_NAME)" in args
    assert "TALLY_USAGE_RECORDS_CA" not in {e["name"] for e in pod["containers"][0]["env"]}
    assert next(v for v in pod["volumes"] if v["name"] == "ledger")["emptyDir"]["sizeLimit"] == "82Mi"
    own = parse_spec({"model": {"name": "m"}, "engine": {"kind": "cpu"},
                      "usageRecords": {"delivery": {"url": "https://elsewhere.example/ingest"}}})
    with pytest.raises(SpecError) as refused:
        check_policy(own, platform)
    assert refused.value.reason == "ForbiddenDelivery"
    with pytest.raises(SpecError):  # refused unless the platform opts in: allowServiceDelivery is off by default
        check_policy(own, OperatorSettings(records_url="https://meter.example/api/v1/events"))
    allowing = OperatorSettings(records_url="https://meter.example/api/v1/events", allow_service_delivery=True,
                                records_proxy="http://egress:3128")
    check_policy(own, allowing)
    args = desired_deployment(META, own, allowing)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--usage-records-url" in args and "--usage-records-pull" not in args
    assert "--usage-records-proxy=http://egress:3128" in args
    # the platform's proxy credentials never reach a serving namespace (a pod's arguments are its team's to read)
    secret = OperatorSettings(records_url="https://meter.example/api/v1/events", allow_service_delivery=True,
                              records_proxy="http://platform:s3cret@egress:3128")
    args = desired_deployment(META, own, secret)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any("s3cret" in arg for arg in args)

"""Names the operator and its resources share: API coordinates, labels, field manager, conditions."""

GROUP = "serving.tally.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "CompletionService"
PLURAL = "completionservices"
SHARD_KIND = "UsageShard"  # a service's per-tenant books, by tenant (shards.py)
LABEL_SHARD_OWNER = f"{GROUP}/service-uid"  # the uid of the CompletionService a UsageShard belongs to
BUDGET_SHARD_KIND = "BudgetShard"  # a Budget's per-tenant slices, by tenant (shards.split_slices)
BUDGET_SHARD_PLURAL = "budgetshards"
LABEL_BUDGET_OWNER = f"{GROUP}/budget-uid"  # the uid of the Budget a BudgetShard belongs to
BUDGET_KIND = "Budget"  # cluster-scoped: the platform team's (platform.py)
BUDGET_PLURAL = "budgets"

FIELD_MANAGER = "tally-operator"

LABEL_SERVICE = f"{GROUP}/completionservice"  # the immutable selector label
LABEL_ACTIVATOR = f"{GROUP}/activator-for"  # the activator pods of a service that scales to zero
ACTIVATOR_SUFFIX = "-activator"  # its Deployment: <name>-activator
BACKEND_SUFFIX = "-pods"  # the Service of the runtime pods alone, which the activator forwards to
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"

# The InferencePool backend (Gateway API Inference Extension v1; docs/DESIGN.md)
POOL_API_VERSION = "inference.networking.k8s.io/v1"
POOL_KIND = "InferencePool"
PICKER_SUFFIX = "-epp"  # the endpoint picker the operator runs for a pool: Deployment, Service, ServiceAccount
PICKER_GRPC_PORT = 9002  # ext_proc, what the gateway calls
PICKER_HEALTH_PORT = 9003
PICKER_METRICS_PORT = 9090
# The picker reads a pod's gauges by the engine named in this label (GIE's, and llm-d's line): Tally's API
# port serves SGLang's names (pool_metrics.py) whatever the engine
ENGINE_TYPE_LABELS = ("inference.networking.k8s.io/engine-type", "llm-d.ai/engine-type")
INFERENCE_POOL_READY = "InferencePoolReady"  # condition type

RUNTIME_PORT = 8000
# Every container the operator makes of the runtime image runs this, by its absolute path: never what a PATH
# (which a spec's environment could set) or a volume would find first under the bare name
RUNTIME_COMMAND = "/opt/tally/bin/tally-runtime"
RUNTIME_PORT_NAME = "http"
# /metrics and the final-read handshake, apart from the API: only the operator needs them
RUNTIME_METRICS_PORT = 8001
RUNTIME_METRICS_PORT_NAME = "metrics"
DELIVERY_DIR = "/etc/tally/delivery"  # the records receiver's token Secret, mounted read-only
DELIVERY_TOKEN_FILE = f"{DELIVERY_DIR}/token"
AUTH_DIR = "/etc/tally/auth"  # the API keys Secret, mounted read-only
API_KEYS_FILE = f"{AUTH_DIR}/api-keys"
CONTAINER_NAME = "runtime"
RUNTIME_UID = 10001
LEDGER_DIR = "/var/lib/tally"  # an emptyDir: outlives the container, so counters survive its restarts
JOURNAL_PATH = f"{LEDGER_DIR}/usage.json"

# Condition types
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
USAGE_HEALTHY = "UsageHealthy"
BUDGET_APPLIED = "BudgetApplied"  # which budgets the service's pods enforce (platform.py), or why none

# Reasons (CamelCase)
REASON_AVAILABLE = "AllReplicasReady"
REASON_ROLLING_OUT = "RollingOut"
REASON_SCALED_TO_ZERO = "ScaledToZero"
REASON_UNSCHEDULABLE = "Unschedulable"
REASON_WAITING = "WaitingForPods"
REASON_SCALING_UP = "ScalingUp"  # more pods asked for than run: those serving still serve
REASON_STABLE = "Stable"
REASON_INVALID_SPEC = "InvalidSpec"
REASON_DEADLINE = "ProgressDeadlineExceeded"
REASON_REPLICA_FAILURE = "ReplicaFailure"
REASON_HEALTHY = "AsExpected"

"""The contract between the runtime and the operator: metric names, label values, engine arguments.

The runtime exports these series and the operator scrapes them; the runtime sets these SGLang arguments
itself and both refuse them in pass-through engine args. Imports nothing, so the operator depends on it
without any of the runtime's dependencies (a test imports the operator with the runtime's engines
blocked). Counters are exposed with Prometheus' `_total` suffix on the wire.
"""

PREFIX = "tally"

REQUESTS = f"{PREFIX}_requests"  # counter{endpoint, outcome, finish_reason}
PROMPT_TOKENS = f"{PREFIX}_prompt_tokens"  # counter, engine-sourced
COMPLETION_TOKENS = f"{PREFIX}_completion_tokens"  # counter, engine-sourced
CACHED_TOKENS = f"{PREFIX}_cached_tokens"  # counter, engine-sourced
USAGE_MISMATCHES = f"{PREFIX}_usage_mismatches"  # counter: engine count != ids streamed
DERIVED_USAGE_REQUESTS = f"{PREFIX}_derived_usage_requests"  # counter: engine reported no usage
STREAM_MODE = f"{PREFIX}_stream_mode"  # gauge{mode}: 1 for the mode in force
INFLIGHT_GENERATIONS = f"{PREFIX}_inflight_generations"  # gauge
GENERATION_SLOTS = f"{PREFIX}_generation_slots"  # gauge: --max-concurrent-generations (busy = inflight / slots)
QUEUED_REQUESTS = f"{PREFIX}_queued_requests"  # gauge: requests waiting for admission
QUEUE_TIME = f"{PREFIX}_queue_time_seconds"  # histogram: time admitted requests waited
TIME_TO_FIRST_TOKEN = f"{PREFIX}_time_to_first_token_seconds"  # histogram
INTER_TOKEN_LATENCY = f"{PREFIX}_inter_token_latency_seconds"  # histogram, observed per token
E2E_LATENCY = f"{PREFIX}_e2e_request_latency_seconds"  # histogram
ENGINE_HEALTHY = f"{PREFIX}_engine_healthy"  # gauge: 1 when the engine can generate
# gauge: when these counters began (unix seconds). It survives a restart of the process when the counter
# journal does (the counters continue); a new value means they started again from zero.
START_TIME = f"{PREFIX}_start_time_seconds"
DRAINING = f"{PREFIX}_draining"  # gauge: 1 once SIGTERM was received (a read when idle then is the final one)
RUNTIME_INFO = f"{PREFIX}_runtime_info"  # gauge{pod_uid}: 1; which pod this runtime says it is
JOURNAL_HEALTHY = f"{PREFIX}_journal_healthy"  # gauge: 0 while the counter journal cannot be written
RECORDS_QUEUED = f"{PREFIX}_usage_records_queued"  # gauge: spooled for --usage-records-url, not yet delivered
RECORDS_OLDEST = f"{PREFIX}_usage_records_oldest_seconds"  # gauge: age of the oldest record not yet delivered
RECORDS_REFUSED = f"{PREFIX}_usage_records_refused"  # counter: spool lines this runtime did not write (not sent)
# --usage-records-pull: GET ?max=N (the records from the last acknowledged position, with `through`), and POST
# {podUid, epoch, through} signed by the operator once it forwarded them (collect.py)
RECORDS_PATH = "/internal/records"
RECORDS_ACK_PATH = "/internal/records/ack"
RECORDS_DELIVERED = f"{PREFIX}_usage_records_delivered"  # counter: taken by the receiver (2xx)
RECORDS_LOST = f"{PREFIX}_usage_records_lost"  # counter{sink}: records not written whole (stdout, file)
STALLED_STREAMS = f"{PREFIX}_stalled_streams"  # counter: streams ended for a client that stopped reading
BUDGET_REMAINING = f"{PREFIX}_budget_remaining_tokens"  # gauge{tenant}: what this pod's lease leaves the tenant
BUDGET_WANTED = f"{PREFIX}_budget_wanted_tokens"  # gauge{tenant}: refused for want of a lease: asks for one
BUDGET_REACH = f"{PREFIX}_budget_allowance_tokens"  # gauge{tenant}: the counter value the pod may still reach
BUDGET_SEQUENCE = f"{PREFIX}_budget_lease_sequence"  # gauge: the number of the lease message applied
BUDGET_REFUSALS = f"{PREFIX}_budget_refusals"  # counter{tenant,code}: 429s, insufficient_quota or rate_limit_exceeded
CONNECTIONS_REFUSED = f"{PREFIX}_connections_refused"  # counter{why}: port, client (before auth), tenant, idle
# The final-read handshake: the operator posts back the final counters it booked (epoch, requests of every
# outcome, prompt, completion and cached tokens); only that ends a drained runtime's wait
FINAL_READ_PATH = "/internal/final-read"
BUDGETS_PATH = "/internal/budgets"  # the operator's signed leases per tenant (budgets.py)
# GET ?wait=N: the operator's long-poll of the tenants whose requests wait for allowance
BUDGET_ASKS_PATH = "/internal/budgets/asks"
READY_PATH = "/ready"  # the readiness probe: healthy, and with budgets holding its first lease
FINAL_READ_SIGNATURE_HEADER = "X-Tally-Signature"  # the operator's Ed25519 signature of the body (handoff.py)
# gauge{kind}: our totals minus SGLang's own counters, taken when no request was in flight (settled)
ENGINE_USAGE_DRIFT = f"{PREFIX}_engine_usage_drift_tokens"

# Per consumer (the tenant header or the OpenAI `user` field), at most --max-tenants label values
TENANT_REQUESTS = f"{PREFIX}_tenant_requests"  # counter{tenant}: requests served (refused ones are not)
TENANT_PROMPT_TOKENS = f"{PREFIX}_tenant_prompt_tokens"  # counter{tenant}
TENANT_COMPLETION_TOKENS = f"{PREFIX}_tenant_completion_tokens"  # counter{tenant}
TENANT_CACHED_TOKENS = f"{PREFIX}_tenant_cached_tokens"  # counter{tenant}
TENANT_OVERFLOW = f"{PREFIX}_tenant_overflow_requests"  # counter: requests booked to OTHER_TENANT
OTHER_TENANT = "other"  # the bucket for tenants beyond the bound
MAX_TENANT_LENGTH = 128  # characters of a tenant's name (printable ones): the operator refuses longer labels
TENANT_SOURCES = f"{PREFIX}_tenant_sources"  # counter{source}: requests by what named their tenant

# SGLang's own counters (its multiprocess collector is served beside ours)
SGLANG_PROMPT_TOKENS = "sglang:prompt_tokens_total"
SGLANG_GENERATION_TOKENS = "sglang:generation_tokens_total"
# Load gauges autoscaling may read (SGLANG_CONTRACT.md §9, 0.5.23's names; a renamed one would read as absent,
# so the queue is read under every name a generation used)
SGLANG_QUEUE_GAUGES = ("sglang:num_queue_reqs",)
SGLANG_KV_CACHE_USAGE = "sglang:token_usage"  # fraction of the KV cache in use

# Label values
OUTCOME_OK = "ok"  # finished normally (stop or length)
OUTCOME_ABORTED = "aborted"  # the client went away
OUTCOME_ERROR = "error"  # the engine failed mid-request
OUTCOME_INVALID = "invalid"  # rejected before generating (4xx)
OUTCOME_OVERLOADED = "overloaded"  # rejected with 503
OUTCOME_OVER_BUDGET = "over_budget"  # 429 insufficient_quota: the tenant's token budget does not cover it
OUTCOME_RATE_LIMITED = "rate_limited"  # 429 rate_limit_exceeded: the tenant's tokens per minute
# Refused before they started: in tally_requests_total, never in usage, per-tenant series or the operator's
# request totals
REFUSED_OUTCOMES = frozenset({OUTCOME_INVALID, OUTCOME_OVERLOADED, OUTCOME_OVER_BUDGET, OUTCOME_RATE_LIMITED})

STREAM_MODES = ("incremental", "cumulative")


def sample_name(counter: str) -> str:
    """The name a counter's sample carries in the text exposition."""
    return f"{counter}_total"


# ---- SGLang arguments

# Incremental streaming, under each generation's name. The runtime always turns it on itself (as a
# constructor argument); in pass-through args either flag is redundant and is dropped, not refused.
STREAMING_FLAGS = frozenset({"--incremental-streaming-output", "--stream-output"})

# Arguments Tally sets itself; passing them through engine args would contradict the runtime (refused).
# The runtime refuses these whoever runs it; a CompletionService may pass only ENGINE_ARG_OPTIONS below.
OWNED_ENGINE_ARGS = frozenset({
    "--model-path", "--model", "--tokenizer-path", "--served-model-name", "--host", "--port",
    "--skip-tokenizer-init", "--context-length", "--tp-size", "--tensor-parallel-size", "--dp-size",
    "--data-parallel-size", "--enable-metrics", "--enable-cache-report", "--trust-remote-code",
    "--mem-fraction-static", "--max-running-requests",
})



# What a CompletionService may pass to SGLang (spec.engine.args), by full option name: scheduling, batching,
# precision and kernel choices. An allow-list, because an option that is not here can load code or leak
# prompts (--trust-remote-code, --tokenizer-path, --speculative-draft-model-path, --lora-paths, --load-format,
# --chat-template (a file in the pod), --log-requests, tracing endpoints). Each item of spec.engine.args is one
# option: `--name=value` for the valued ones (a value of letters, digits and `._:+,-`, no paths), `--name` for
# the switches. The CRD and the chart's admission policy hold the same list (`engine_args_pattern`, a test keeps
# them equal); the runtime parses with abbreviations off and its own arguments win. Names are SGLang 0.5.23's
# (tests/sglang checks each against its parser); an older SGLang that lacks one refuses it at start-up.
ENGINE_ARG_VALUES = frozenset({
    "--stream-interval", "--schedule-policy", "--schedule-conservativeness", "--chunked-prefill-size",
    "--max-prefill-tokens", "--max-total-tokens", "--page-size", "--dtype", "--kv-cache-dtype", "--quantization",
    "--attention-backend", "--sampling-backend", "--grammar-backend", "--random-seed", "--watchdog-timeout",
    "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill", "--num-continuous-decode-steps",
    "--tool-call-parser", "--reasoning-parser", "--constrained-json-max-whitespace-cnt",
    "--device",
})
ENGINE_ARG_SWITCHES = frozenset({
    "--disable-radix-cache", "--disable-cuda-graph", "--disable-overlap-schedule", "--enable-mixed-chunk",
    "--enable-torch-compile", "--enable-dp-attention", "--skip-server-warmup", "--sleep-on-idle",
    "--constrained-json-disable-any-whitespace", *STREAMING_FLAGS,
})
ENGINE_ARG_VALUE_CHARS = "A-Za-z0-9._:+,-"
MAX_ENGINE_ARG_VALUE = 128


def engine_args_pattern() -> str:
    """The regular expression every item of spec.engine.args must match (RE2 and Python alike)."""
    values = "|".join(sorted(name.removeprefix("--") for name in ENGINE_ARG_VALUES))
    switches = "|".join(sorted(name.removeprefix("--") for name in ENGINE_ARG_SWITCHES))
    return f"^--(({values})=[{ENGINE_ARG_VALUE_CHARS}]{{1,{MAX_ENGINE_ARG_VALUE}}}|({switches}))$"

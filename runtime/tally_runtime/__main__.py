"""`tally-runtime serve ...`: settings -> engine -> create_app -> uvicorn."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from tally_runtime.auth import KeysFileError
from tally_runtime.engine.base import Engine
from tally_runtime.settings import Settings, from_environment

if TYPE_CHECKING:
    from tally_runtime.http_limits import Connections

USAGE = "usage: tally-runtime {serve,activate} [--help] [options]"


def build_engine(settings: Settings) -> Engine:
    """Adapters import their heavy engines lazily, so one never needs the other's dependencies."""
    if settings.engine == "sglang":
        from tally_runtime.engine.sglang import SGLangEngine

        return SGLangEngine(settings.engine_config())
    from tally_runtime.engine.llamacpp import LlamaCppEngine

    try:
        engine = LlamaCppEngine.from_config(settings.engine_config())
    except FileNotFoundError as err:
        fail(str(err))
    if not engine.model_path.is_file():
        fail(f"--model-path {settings.model_path!r} is not a GGUF file")
    return engine


def fail(message: str) -> NoReturn:
    print(f"tally-runtime serve: error: {message}", file=sys.stderr)
    sys.exit(2)


def serve(settings: Settings) -> None:
    import uvicorn

    from tally_runtime.app import create_app
    from tally_runtime.http_limits import bounded_protocol

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server: uvicorn.Server | None = None

    def exit_now() -> None:
        assert server is not None
        server.should_exit = True

    connections = connections_for(settings)
    try:
        app = create_app(settings, build_engine(settings), exit_now, connections)
    except KeysFileError as err:
        fail(str(err))
    protocol = bounded_protocol(settings.max_header_bytes, settings.header_timeout_seconds,
                                settings.body_timeout_seconds, connections)
    # Connections are capped per port by `connections` (uvicorn's own limit counts every port as one). The
    # graceful shutdown ends connections the drain could not (a client that stopped reading) in time for
    # the pod's grace period. Idle connections stay open longer than pooled clients keep them
    # (--keep-alive-seconds): uvicorn's 5 s equals httpx's, and the two ends closing and reusing one
    # connection at the same moment is a reset on the client's request.
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                           access_log=False, http=protocol,
                                           timeout_keep_alive=settings.keep_alive_seconds,
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS))
    sockets = [listening_socket(settings.host, settings.port)]
    if settings.metrics_port:
        sockets.append(listening_socket(settings.host, settings.metrics_port))
    server.run(sockets=sockets)


GRACEFUL_SHUTDOWN_SECONDS = 5


def connections_for(settings: Settings) -> Connections:
    """The API port holds --max-connections; the metrics port (probes, the operator) its own, small cap."""
    from tally_runtime.http_limits import Connections

    caps = {settings.port: settings.max_connections}
    per_address = {}
    if settings.metrics_port:
        caps[settings.metrics_port] = settings.max_metrics_connections
        per_address[settings.metrics_port] = settings.max_metrics_connections_per_client
    per_client = settings.max_unauthenticated_connections_per_client if settings.api_keys_file else 0
    return Connections(caps, settings.max_connections, per_client, authenticated_ports=frozenset({settings.port}),
                       per_client_caps=per_address,
                       per_tenant=settings.max_connections_per_tenant if settings.api_keys_file else 0,
                       probation=PROBATION_SECONDS)


# A connection past its address's pre-authentication bound is admitted, and must authenticate within this long:
# clients behind one gateway address open their connections at once and authenticate in milliseconds
PROBATION_SECONDS = 2.0


def listening_socket(host: str, port: int) -> socket.socket:
    """`::` listens on IPv6 and IPv4 alike (pods may get either address); where the kernel has no IPv6,
    it falls back to every IPv4 address."""
    if host == "::":
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        except OSError:
            host, sock = "0.0.0.0", socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        fail(f"cannot listen on {host}:{port}: {err}")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(USAGE)
        print("\ncommands:\n  serve    run the OpenAI-compatible server (see 'tally-runtime serve --help')"
              "\n  activate hold a scaled-to-zero service's requests until a pod is ready")
        sys.exit(0 if args else 2)
    if args[0] == "activate":
        from tally_runtime.activator import main as activate

        activate(args[1:])
        return
    if args[0] != "serve":
        print(f"{USAGE}\ntally-runtime: unknown command {args[0]!r}", file=sys.stderr)
        sys.exit(2)
    serve(from_environment(args[1:]))


if __name__ == "__main__":
    main()

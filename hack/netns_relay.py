#!/usr/bin/env python3
"""A TCP relay from a loopback port of this machine into the cluster's own network namespace.

    netns_relay.py --netns NAME --listen 127.0.0.1:PORT --to ADDRESS:PORT     every connection to one address
    netns_relay.py --netns NAME --listen 127.0.0.1:PORT --socks --secret-file F --allow CIDR[:PORT] ...

The listening socket is made in the caller's namespace (so only loopback is ever bound here); the
process then joins NAME's network namespace, so every connection it opens goes to an address inside
that namespace. With --socks each client names its own target (SOCKS5 CONNECT, RFC 1928), the way
`curl --proxy socks5://tally:SECRET@127.0.0.1:PORT http://<pod or ClusterIP>:8000/...` and httpx's
`proxy=` do. A SOCKS client must authenticate (RFC 1929, user `tally`, the password in --secret-file,
which only the user who started the cluster can read), and may only reach the addresses --allow lists
(the pod and Service ranges, and the API server's port on the node): never the namespace's loopback,
where etcd and the control plane's own ports are, and never a name. What is refused is answered with
SOCKS's "not allowed by ruleset" and logged. Standard library only: the cluster scripts run it with any
Python 3.11.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hmac
import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
Target = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable["tuple[str, int] | None"]]
USER = b"tally"


def join_netns(name: str) -> None:
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name} failed")
    finally:
        os.close(fd)


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


def fixed(host: str, port: int) -> Target:
    async def target(_r: asyncio.StreamReader, _w: asyncio.StreamWriter) -> tuple[str, int]:
        return host, port

    return target


@dataclass(frozen=True)
class Rule:
    """Destinations a SOCKS client may reach: a network, and optionally one port on it."""

    network: ipaddress.IPv4Network
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> Rule:
        network, _, port = text.partition(":")
        return cls(ipaddress.IPv4Network(network), int(port) if port else None)

    def allows(self, address: ipaddress.IPv4Address, port: int) -> bool:
        return address in self.network and self.port in (None, port)


def allowed(rules: Sequence[Rule], host: str, port: int) -> bool:
    address = ipaddress.IPv4Address(host)
    return not address.is_loopback and any(rule.allows(address, port) for rule in rules)


SOCKS_OK, SOCKS_FAILED, SOCKS_NOT_ALLOWED, SOCKS_UNREACHABLE = 0, 1, 2, 4
SOCKS_NO_COMMAND, SOCKS_NO_ADDRESS_TYPE = 7, 8
NO_AUTH, PASSWORD, NO_METHOD = 0, 2, 0xFF


def socks_reply(code: int) -> bytes:
    return struct.pack("!BBBB4sH", 5, code, 0, 1, bytes(4), 0)


def refuse(writer: asyncio.StreamWriter, code: int, why: str) -> None:
    peer = writer.get_extra_info("peername")
    print(f"[relay] refused {peer}: {why}", file=sys.stderr, flush=True)
    writer.write(socks_reply(code))


def socks(secret: bytes, rules: Sequence[Rule]) -> Target:
    async def target(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, int] | None:
        """RFC 1928's greeting, RFC 1929's password, then a CONNECT to an allowed IPv4 address; the reply is
        sent once the connection is made (or not)."""
        version, count = await reader.readexactly(2)
        methods = await reader.readexactly(count)
        if version != 5 or PASSWORD not in methods:
            writer.write(bytes((5, NO_METHOD)))  # only username and password are accepted
            return None
        writer.write(bytes((5, PASSWORD)))
        _, user_length = await reader.readexactly(2)
        user = await reader.readexactly(user_length)
        password = await reader.readexactly((await reader.readexactly(1))[0])
        if not (hmac.compare_digest(user, USER) & hmac.compare_digest(password, secret)):
            writer.write(b"\x01\x01")
            print(f"[relay] refused {writer.get_extra_info('peername')}: wrong credentials", file=sys.stderr,
                  flush=True)
            return None
        writer.write(b"\x01\x00")
        _, command, _, kind = await reader.readexactly(4)
        if kind == 1:
            host = str(ipaddress.IPv4Address(await reader.readexactly(4)))
        else:
            refuse(writer, SOCKS_NO_ADDRESS_TYPE, "only IPv4 addresses are relayed, never names")
            return None
        (port,) = struct.unpack("!H", await reader.readexactly(2))
        if command != 1:
            refuse(writer, SOCKS_NO_COMMAND, "only CONNECT")
            return None
        if not allowed(rules, host, port):
            refuse(writer, SOCKS_NOT_ALLOWED, f"{host}:{port} is outside the pod and Service ranges")
            return None
        return host, port

    return target


async def serve(listener: socket.socket, target: Target, socks_mode: bool) -> None:
    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            address = await asyncio.wait_for(target(client_r, client_w), 10)
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError):
            address = None
        if address is None:
            client_w.close()
            return
        try:
            upstream_r, upstream_w = await asyncio.wait_for(asyncio.open_connection(*address), 10)
        except (TimeoutError, OSError):
            if socks_mode:
                client_w.write(socks_reply(SOCKS_UNREACHABLE))
            client_w.close()
            return
        if socks_mode:
            client_w.write(socks_reply(SOCKS_OK))
        await asyncio.gather(pipe(client_r, upstream_w), pipe(upstream_r, client_w))
        for w in (client_w, upstream_w):
            w.close()

    server = await asyncio.start_server(relay, sock=listener)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--netns", required=True)
    parser.add_argument("--listen", required=True, help="127.x.y.z:PORT (loopback only)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to", help="ADDRESS:PORT inside the namespace")
    mode.add_argument("--socks", action="store_true", help="a SOCKS5 proxy into the namespace")
    parser.add_argument("--secret-file", help="with --socks: the password clients must give (user 'tally')")
    parser.add_argument("--allow", action="append", default=[], type=Rule.parse, metavar="CIDR[:PORT]",
                        help="with --socks: a destination clients may reach (repeatable)")
    args = parser.parse_args()
    listen_host, listen_port = args.listen.rsplit(":", 1)
    if not listen_host.startswith("127."):
        parser.error("--listen must be a loopback address")
    if args.socks:
        if not args.secret_file or not args.allow:
            parser.error("--socks needs --secret-file and at least one --allow")
        with open(args.secret_file, "rb") as file:
            secret = file.read().strip()
        if len(secret) < 16:
            parser.error("the secret must be at least 16 bytes")
        target = socks(secret, args.allow)
    else:
        to_host, to_port = args.to.rsplit(":", 1)
        target = fixed(to_host, int(to_port))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((listen_host, int(listen_port)))
    listener.listen(512)
    join_netns(args.netns)
    asyncio.run(serve(listener, target, args.socks))


if __name__ == "__main__":
    main()

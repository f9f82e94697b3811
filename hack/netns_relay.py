#!/usr/bin/env python3
"""A TCP relay from a loopback port of this machine into the cluster's own network namespace.

    netns_relay.py --netns NAME --listen 127.0.0.1:PORT --to ADDRESS:PORT   every connection to one address
    netns_relay.py --netns NAME --listen 127.0.0.1:PORT --socks             a SOCKS5 proxy (CONNECT, no auth)

The listening socket is made in the caller's namespace (so only loopback is ever bound here); the
process then joins NAME's network namespace, so every connection it opens goes to an address inside
that namespace (the node's bridge, a pod, a Service's ClusterIP). With --socks each client names its
own target, the way `curl --proxy socks5://127.0.0.1:PORT http://<pod or ClusterIP>:8000/...` and
httpx's `proxy=` do. Standard library only: the cluster scripts run it with any Python 3.11.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ipaddress
import os
import socket
import struct
from collections.abc import Awaitable, Callable

CLONE_NEWNET = 0x40000000
Target = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable["tuple[str, int] | None"]]


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


SOCKS_OK, SOCKS_FAILED, SOCKS_UNREACHABLE, SOCKS_NO_COMMAND, SOCKS_NO_ADDRESS_TYPE = 0, 1, 4, 7, 8


def socks_reply(code: int) -> bytes:
    return struct.pack("!BBBB4sH", 5, code, 0, 1, bytes(4), 0)


async def socks_target(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, int] | None:
    """RFC 1928's greeting and CONNECT request; the reply is sent once the connection is made (or not)."""
    version, count = await reader.readexactly(2)
    methods = await reader.readexactly(count)
    if version != 5 or 0 not in methods:
        writer.write(b"\x05\xff")  # no acceptable method: we only offer "no authentication"
        return None
    writer.write(b"\x05\x00")
    version, command, _, kind = await reader.readexactly(4)
    if kind == 1:
        host = str(ipaddress.IPv4Address(await reader.readexactly(4)))
    elif kind == 4:
        host = str(ipaddress.IPv6Address(await reader.readexactly(16)))
    elif kind == 3:
        host = (await reader.readexactly((await reader.readexactly(1))[0])).decode("idna")
    else:
        writer.write(socks_reply(SOCKS_NO_ADDRESS_TYPE))
        return None
    (port,) = struct.unpack("!H", await reader.readexactly(2))
    if command != 1:
        writer.write(socks_reply(SOCKS_NO_COMMAND))
        return None
    return host, port


async def serve(listener: socket.socket, target: Target, socks: bool) -> None:
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
            if socks:
                client_w.write(socks_reply(SOCKS_UNREACHABLE))
            client_w.close()
            return
        if socks:
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
    args = parser.parse_args()
    listen_host, listen_port = args.listen.rsplit(":", 1)
    if not listen_host.startswith("127."):
        parser.error("--listen must be a loopback address")
    if args.socks:
        target = socks_target
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

#!/usr/bin/env python3
"""A TCP relay from a loopback port of this machine into the cluster's own network namespace.

    netns_relay.py --netns NAME --listen 127.0.0.1:PORT --to ADDRESS:PORT

The listening socket is made in the caller's namespace (so only loopback is ever bound here); the
process then joins NAME's network namespace, so every connection it opens goes to an address inside
that namespace (the node's bridge, a pod, a Service's ClusterIP). Standard library only: the cluster
scripts run it with any Python 3.11.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import socket

CLONE_NEWNET = 0x40000000


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


async def serve(listener: socket.socket, host: str, port: int) -> None:
    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            upstream_r, upstream_w = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        except (TimeoutError, OSError):
            client_w.close()
            return
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
    parser.add_argument("--to", required=True, help="ADDRESS:PORT inside the namespace")
    args = parser.parse_args()
    listen_host, listen_port = args.listen.rsplit(":", 1)
    if not listen_host.startswith("127."):
        parser.error("--listen must be a loopback address")
    to_host, to_port = args.to.rsplit(":", 1)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((listen_host, int(listen_port)))
    listener.listen(512)
    join_netns(args.netns)
    asyncio.run(serve(listener, to_host, int(to_port)))


if __name__ == "__main__":
    main()

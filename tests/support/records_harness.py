"""A billing system's ingest endpoint for the record delivery tests, and what clients were told."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

TOKEN = "meter-token-0123456789"


class Receiver:
    """An ingest endpoint: takes CloudEvents batches with the right token, unless told to fail."""

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}
        self.posts = 0
        self.failing = False
        self.latency = 0.0  # seconds each POST takes before it is answered
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if receiver.latency:
                    time.sleep(receiver.latency)
                with receiver.lock:
                    receiver.posts += 1
                    ok = (not receiver.failing and self.headers["Authorization"] == f"Bearer {TOKEN}"
                          and self.headers["Content-Type"] == "application/cloudevents-batch+json")
                    if ok:
                        for event in json.loads(body):
                            receiver.events[event["id"]] = event  # deduplicated by id
                self.send_response(202 if ok else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/events"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def usage(self) -> tuple[int, int, int]:
        with self.lock:
            data = [e["data"] for e in self.events.values()]
        return len(data), sum(d["prompt_tokens"] for d in data), sum(d["completion_tokens"] for d in data)


def receiving() -> Iterator[Receiver]:
    """A receiver for a test (the `receiver` fixture, tests/contract/conftest.py)."""
    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()


def serve(url: str, count: int) -> list[dict[str, int]]:
    with httpx.Client(base_url=url, timeout=60) as http:
        return [http.post("/v1/completions", json={"prompt": f"Item {i}:", "max_tokens": 4}).json()["usage"]
                for i in range(count)]


def told(usages: list[dict[str, int]]) -> tuple[int, int, int]:
    return len(usages), sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages)


def private_ca(directory: Path) -> tuple[Path, Path, Path]:
    """A CA of the platform's own and a server certificate for 127.0.0.1 it signed: (CA, cert, key) PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "platform-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meter")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class Proxy:
    """A forward HTTP proxy (absolute-form requests): counts what passes through it."""

    def __init__(self) -> None:
        self.forwarded = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "proxy-connection",
                                                                                     "connection")}
                reply = httpx.post(self.path, content=body, headers=headers, timeout=30)
                proxy.forwarded += 1
                self.send_response(reply.status_code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

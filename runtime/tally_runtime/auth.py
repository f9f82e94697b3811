"""API keys that name tenants (`--api-keys-file`), and who a request is billed to.

The file holds one key per line, `<tenant> <key>`, or `<tenant> <key> gateway` for a gateway's key; blank
lines and `#` comments are ignored. It is meant to be a key of a Kubernetes Secret mounted as a volume: the
kubelet replaces the file in place when the Secret changes, and the runtime notices (it looks at the file's
identity at most once a second) and reloads it, so a rotation needs no restart. Revocation fails closed: a
file that turns unreadable, is removed, or holds no usable key leaves no key valid (every request is a 401,
the log says why and /health is 503 with the reason, so the pod leaves its Service) until a good file is
back; at start-up, such a file stops the runtime. Lines it cannot use are reported by line number, never by
content: a key must not reach a log.

Keys are held only as SHA-256 digests; a presented key is hashed and looked up, so nothing compares the
secret itself. Key checking is per request, not per token (benchmarks/README.md measures its cost).

Who is billed (`resolve`): with keys, the key's tenant; the tenant header then counts only in gateway mode
(`--trust-tenant-header`) and only for a key marked `gateway`: such a key authenticates a gateway that names
the tenant, and any other key that sends the header is refused (403), never billed to the name it gives.
Without keys, the tenant header, else the OpenAI `user` field, else `anonymous` (anyone who reaches the pod
chooses what it is billed to: run without keys only behind a gateway that sets the header). Whenever the
header is taken, a request carrying it twice is refused rather than billed to the first one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tally_runtime import contract
from tally_runtime.protocol import ApiError

log = logging.getLogger("tally_runtime.auth")

MAX_KEYS_FILE_BYTES = 1 << 20
RELOAD_SECONDS = 1.0
NO_TENANT = "anonymous"  # requests that named no consumer

# Where a request's tenant came from (usage records and tally_tenant_sources_total)
SOURCE_KEY, SOURCE_HEADER, SOURCE_USER, SOURCE_NONE = "key", "header", "user", "none"
SOURCES = (SOURCE_KEY, SOURCE_HEADER, SOURCE_USER, SOURCE_NONE)


class KeysFileError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    source: str


@dataclass(frozen=True, slots=True)
class Key:
    """What a valid API key stands for: its tenant, and whether it is a gateway's (which may name tenants)."""

    tenant: str
    gateway: bool = False


GATEWAY_MARK = "gateway"


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str) -> tuple[dict[bytes, Key], list[str]]:
    """Key digest -> what it stands for, and the problems found (by line number only)."""
    keys: dict[bytes, Key] = {}
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != GATEWAY_MARK):
            problems.append(f"line {number}: expected '<tenant> <key>' or '<tenant> <key> {GATEWAY_MARK}'")
            continue
        tenant, key = parts[:2]
        problem = tenant_problem(tenant) or ("the key is shorter than 16 characters" if len(key) < 16 else "")
        if problem:
            problems.append(f"line {number}: {problem}")
        elif digest(key) in keys:
            problems.append(f"line {number}: a key given twice (the first one's tenant keeps it)")
        else:
            keys[digest(key)] = Key(tenant, gateway=len(parts) == 3)
    return keys, problems


def tenant_problem(tenant: str) -> str:
    if len(tenant) > contract.MAX_TENANT_LENGTH or not tenant.isprintable():
        return f"a tenant name must be printable and at most {contract.MAX_TENANT_LENGTH} characters"
    if tenant in {contract.OTHER_TENANT, NO_TENANT}:
        return f"the tenant name {tenant!r} is reserved"
    return ""


class ApiKeys:
    """The keys of one file, reloaded when the file changes; none valid while it cannot be used."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.keys: dict[bytes, Key] = {}
        self.identity: tuple[int, int, int, int] | None = None
        self.checked = 0.0
        self.problem = ""  # why no key is valid now (empty: the file's keys are in force)
        self._load(initial=True)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(k.tenant for k in self.keys.values())

    def key_of(self, key: str) -> Key | None:
        self.maybe_reload()
        return self.keys.get(digest(key))

    def maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self.checked >= RELOAD_SECONDS:
            self.checked = now
            self._load(initial=False)

    def _load(self, initial: bool) -> None:
        try:
            stat = os.stat(self.path)
            identity = (stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if identity == self.identity:
                return
            if stat.st_size > MAX_KEYS_FILE_BYTES:
                raise KeysFileError(f"larger than {MAX_KEYS_FILE_BYTES} bytes")
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError, KeysFileError) as err:
            why = f"cannot read the API keys file {self.path}: {type(err).__name__}"
            if initial:
                raise KeysFileError(why) from None
            self._revoke_all(why, None)
            return
        keys, problems = parse_keys(text)
        for problem in problems:
            log.error("API keys file %s, %s: that line is ignored", self.path, problem)
        if not keys:
            why = f"the API keys file {self.path} holds no usable key"
            if initial:
                raise KeysFileError(why)
            self._revoke_all(why, identity)
            return
        if not initial and (keys != self.keys or self.problem):
            log.info("API keys reloaded from %s: %d key(s) for %d tenant(s)", self.path, len(keys),
                     len({k.tenant for k in keys.values()}))
        self.keys, self.problem, self.identity = keys, "", identity

    def _revoke_all(self, why: str, identity: tuple[int, int, int, int] | None) -> None:
        """Fail closed: the keys a file no longer holds are no longer valid, so none is."""
        if self.problem != why:
            log.error("%s: no API key is valid until it is fixed (every request gets 401)", why)
        self.keys, self.problem, self.identity = {}, why, identity


def bearer(values: Sequence[str]) -> str | None:
    """The key of an `Authorization: Bearer <key>` header (exactly one such header), else None."""
    if len(values) != 1:
        return None
    scheme, _, key = values[0].strip().partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


# A refused key closes its connection: a client without a key gets no keep-alive connection to hold
UNAUTHENTICATED_HEADERS = {"connection": "close"}


def authenticate(keys: ApiKeys | None, authorization: Sequence[str]) -> Key | None:
    """What the request's API key stands for; None when no keys are configured. A missing or wrong key is
    the OpenAI 401 (`invalid_api_key`), and the connection closes after it."""
    if keys is None:
        return None
    key = bearer(authorization)
    if key is None:
        raise ApiError(401, "You didn't provide an API key. Provide it as 'Authorization: Bearer <key>'.",
                       code="invalid_api_key", headers=UNAUTHENTICATED_HEADERS)
    found = keys.key_of(key)
    if found is None:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key", headers=UNAUTHENTICATED_HEADERS)
    return found


def resolve(keyed: Key | None, tenant_headers: Sequence[str], trust_header: bool, header_name: str,
            user: str | None) -> Tenant:
    """Who the request is billed to: the key's tenant (a gateway key's header in gateway mode), or without
    keys the header, the `user` field, or nobody. 400 for a tenant header given twice or the reserved
    `other`; 403 for a tenant header sent with a key that is not a gateway's."""
    if keyed is not None and not keyed.gateway and header_name and tenant_headers and trust_header:
        raise ApiError(403, f"This API key may not name a tenant with the {header_name} header: only a key "
                            "marked 'gateway' may", param=header_name, code="tenant_header_not_allowed")
    if trust_header and header_name:
        if len(tenant_headers) > 1:
            raise ApiError(400, f"The {header_name} header was given {len(tenant_headers)} times; give it once",
                           param=header_name, code="invalid_tenant")
        if tenant_headers and tenant_headers[0].strip():
            return named(tenant_headers[0], SOURCE_HEADER, header_name)
    if keyed is not None:
        return Tenant(keyed.tenant, SOURCE_KEY)
    if user and user.strip():
        return named(user, SOURCE_USER, "user")
    return Tenant(NO_TENANT, SOURCE_NONE)


def named(value: str, source: str, param: str) -> Tenant:
    """A tenant a request names itself (header or `user`); `other` is refused: it is the overflow bucket."""
    tenant = value.strip()[:contract.MAX_TENANT_LENGTH]
    if tenant == contract.OTHER_TENANT:
        raise ApiError(400, f"The tenant name {tenant!r} is reserved for tenants beyond the server's bound; use "
                            "another name", param=param, code="invalid_tenant")
    return Tenant(tenant, source)

"""The operator's signing key for the final-read hand-off (tally_runtime/handoff.py).

The chart keeps an Ed25519 private key in a Secret of the operator's own namespace and mounts it; the
operator reads it once at start-up. Its public key goes into every runtime pod's environment. Without a
key file (an operator run by hand) a key is made for this process only: its pods then roll when it
restarts, because their environment names a new key."""

from __future__ import annotations

import base64
import hashlib
import logging
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

log = logging.getLogger("tally_operator")


class Signer:
    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_key = base64.b64encode(raw).decode()

    @classmethod
    def load(cls, path: str) -> Signer:
        """From a PEM (PKCS#8) file, or a new key for this process when `path` is empty."""
        if not path:
            log.warning("No signing key file: using a key of this process only (pods roll when it restarts)")
            return cls(Ed25519PrivateKey.generate())
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} does not hold an Ed25519 private key")
        return cls(key)

    def sign(self, body: bytes) -> str:
        return base64.b64encode(self._key.sign(body)).decode()

    def derived_key(self, purpose: str) -> str:
        """A key for `purpose` (the shards' hash key of one object): the same in every process holding this key
        (an Ed25519 signature is deterministic), and no one without it can compute it."""
        return hashlib.sha256(self.sign(purpose.encode()).encode()).hexdigest()[:32]

"""The final-read hand-off's signature: only the operator that holds the private key can end a drain.

The operator signs the exact bytes of its acknowledgement with Ed25519 and sends the signature in the
`X-Tally-Signature` header; the pod verifies them with the operator's public key, which the operator puts
in the pod's environment (`TALLY_FINAL_READ_KEY`: public, so anyone who can read the pod spec learns
nothing that lets them sign). The acknowledgement names the pod's uid, its counters' epoch and exactly its
final counters, so a signed one is good for that pod's last moments only. `cryptography` is imported only
when a key is configured (a runtime run without an operator has no hand-off to protect).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from tally_runtime.contract import FINAL_READ_SIGNATURE_HEADER

SIGNATURE_HEADER = FINAL_READ_SIGNATURE_HEADER
KEY_BYTES = 32  # an Ed25519 public key
SIGNATURE_BYTES = 64


def public_key(text: str) -> Any:
    """The Ed25519 public key from its base64 text (ValueError when it is not one)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except binascii.Error:
        raise ValueError("the final-read key is not base64") from None
    if len(raw) != KEY_BYTES:
        raise ValueError(f"the final-read key is {len(raw)} bytes, not an Ed25519 public key's {KEY_BYTES}")
    return Ed25519PublicKey.from_public_bytes(raw)


def verify(key: Any, body: bytes, signature: str | None) -> bool:
    """Whether `signature` (base64) is the key holder's over exactly `body`."""
    from cryptography.exceptions import InvalidSignature

    if not signature or len(signature) > 2 * SIGNATURE_BYTES:
        return False
    try:
        raw = base64.b64decode(signature.strip(), validate=True)
        key.verify(raw, body)
    except (binascii.Error, InvalidSignature, ValueError):
        return False
    return True

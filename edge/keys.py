"""Ed25519 keys for routing tables: load them from PEM or raw base64, and name them.

The control plane signs with a private key; edges hold only the public one. Both are
accepted as PEM (PKCS#8 / SubjectPublicKeyInfo) or as the raw 32 bytes in base64, so an
operator can paste a key into an environment variable or a config map.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)


class KeyFormatError(ValueError):
    """A key that is not an Ed25519 key in a form we read; the message says why."""


def _raw_from_base64(text: str) -> bytes | None:
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 32 else None


def load_public_key(data: bytes | str) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM text or base64 of its 32 raw bytes."""
    text = data.decode() if isinstance(data, bytes) else data
    if "-----BEGIN" in text:
        try:
            key = serialization.load_pem_public_key(text.encode())
        except ValueError as exc:
            raise KeyFormatError(f"not a PEM public key: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise KeyFormatError(f"expected an Ed25519 public key, got {type(key).__name__}")
        return key
    raw = _raw_from_base64(text)
    if raw is None:
        raise KeyFormatError("expected PEM or base64 of 32 raw bytes for an Ed25519 public key")
    return Ed25519PublicKey.from_public_bytes(raw)


def load_private_key(data: bytes | str) -> Ed25519PrivateKey:
    """An Ed25519 private key from unencrypted PEM or base64 of its 32-byte seed."""
    text = data.decode() if isinstance(data, bytes) else data
    if "-----BEGIN" in text:
        try:
            key = serialization.load_pem_private_key(text.encode(), password=None)
        except (ValueError, TypeError) as exc:
            raise KeyFormatError(f"not an unencrypted PEM private key: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFormatError(f"expected an Ed25519 private key, got {type(key).__name__}")
        return key
    raw = _raw_from_base64(text)
    if raw is None:
        raise KeyFormatError("expected PEM or base64 of a 32-byte seed for an Ed25519 private key")
    return Ed25519PrivateKey.from_private_bytes(raw)


def load_public_key_file(path: str | Path) -> Ed25519PublicKey:
    return load_public_key(Path(path).read_bytes())


def public_key_id(key: Ed25519PublicKey) -> str:
    """The short id a table's `key_id` carries: sha256 of the raw public key, 16 hex digits."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_key_pem(key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )

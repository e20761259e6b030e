"""The control plane's Ed25519 signing key: where it comes from, and signing tables with it.

The key comes from MERIDIAN_SIGNING_KEY (PEM text) or the file named by
MERIDIAN_SIGNING_KEY_FILE (default var/keys/signing-key.pem, written by
`python manage.py generate_signing_key`); never from the repository. The canonical form
that is signed is the edge's own (`edge.table.canonical_bytes`), so both sides agree by
construction.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from edge.table import canonical_bytes as edge_canonical_bytes
from edge.table import sign_table, table_hash


def default_key_path() -> Path:
    return Path(os.environ.get("MERIDIAN_SIGNING_KEY_FILE", settings.VAR_DIR / "keys" / "signing-key.pem"))


def generate_key_files(private_path: Path, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new private key (0600) and its public key beside it (`.pub.pem`)."""
    public_path = private_path.with_suffix(".pub.pem")
    if private_path.exists() and not overwrite:
        raise FileExistsError(f"{private_path} exists; pass --force to replace it")
    private_path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private_pem)
    public_path.write_bytes(public_pem(key))
    return private_path, public_path


def public_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@lru_cache(maxsize=1)
def signing_key() -> Ed25519PrivateKey:
    text = os.environ.get("MERIDIAN_SIGNING_KEY")
    source = "MERIDIAN_SIGNING_KEY"
    if not text:
        path = default_key_path()
        source = f"MERIDIAN_SIGNING_KEY_FILE ({path})"
        if not path.exists():
            raise ImproperlyConfigured(
                f"{source} does not exist; run `python manage.py generate_signing_key`"
            )
        text = path.read_text()
    try:
        key = serialization.load_pem_private_key(text.encode(), password=None)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{source} is not a PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ImproperlyConfigured(f"{source} must hold an Ed25519 key")
    return key


def key_id(key: Ed25519PrivateKey | None = None) -> str:
    raw = (key or signing_key()).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return hashlib.sha256(raw).hexdigest()[:16]


def canonical_bytes(table: dict[str, Any]) -> bytes:
    return edge_canonical_bytes(table)


def sign(table: dict[str, Any], key: Ed25519PrivateKey | None = None) -> dict[str, Any]:
    """The table with `signature`: Ed25519 over the canonical bytes of everything else."""
    return sign_table(table, key or signing_key())


def payload_hash(table: dict[str, Any]) -> str:
    """sha256 of the canonical bytes; for a signed table, the ETag edges send back."""
    return table_hash(table)

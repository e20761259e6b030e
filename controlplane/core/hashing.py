"""Secret generation and hashing for API tokens and inference keys.

Tokens and keys are 256-bit random strings, so a plain SHA-256 is a sound one-way store
(no password stretching needed) and is what edges match keys against.
"""

from __future__ import annotations

import hashlib
import secrets

TOKEN_PREFIX = "mrd_"
KEY_PREFIX = "sk-mrd-"


def sha256_hex(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def display_prefix(secret: str) -> str:
    """The first characters of a secret, kept so people can tell their keys apart."""
    return secret[:12]

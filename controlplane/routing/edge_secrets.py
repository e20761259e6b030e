"""Each edge's admin secret, derived from one key of the control plane's: nothing stored.

An edge's secret is HMAC-SHA256(edge admin key, "meridian-edge-admin:" + edge name), in hex;
the control plane signs every admin request to that edge with it (`edge.admin_auth`), and
the edge is started with it (`python -m edge --admin-secret-file`, which
`manage.py edge_admin_secret NAME` prints). A leaked database holds no secret; rotating the
key rotates every edge's.

The key comes from MERIDIAN_EDGE_ADMIN_KEY (text, at least 32 characters) or the file named
by MERIDIAN_EDGE_ADMIN_KEY_FILE (default var/keys/edge-admin.key, written by
`manage.py generate_signing_key` beside the signing key; the lab, MERIDIAN_LAB=1, makes one
where there is none).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from functools import lru_cache
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

MIN_KEY_CHARS = 32


def default_key_path() -> Path:
    return Path(os.environ.get("MERIDIAN_EDGE_ADMIN_KEY_FILE",
                               settings.VAR_DIR / "keys" / "edge-admin.key"))


def generate_key_file(path: Path, overwrite: bool = False) -> Path:
    """Write a new random key (0600); an existing one is kept unless `overwrite`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:  # kept: another process made it first, or it was there
        return path
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32) + "\n")
    admin_key.cache_clear()
    return path


@lru_cache(maxsize=1)
def admin_key() -> bytes:
    text = os.environ.get("MERIDIAN_EDGE_ADMIN_KEY", "")
    source = "MERIDIAN_EDGE_ADMIN_KEY"
    if not text:
        path = default_key_path()
        source = f"MERIDIAN_EDGE_ADMIN_KEY_FILE ({path})"
        if not path.exists() and settings.LAB:
            generate_key_file(path)  # the lab makes its own, like its other keys
        if not path.exists():
            raise ImproperlyConfigured(
                f"{source} does not exist; run `python manage.py generate_signing_key`")
        text = path.read_text()
    text = text.strip()
    if len(text) < MIN_KEY_CHARS:
        raise ImproperlyConfigured(f"{source} must hold at least {MIN_KEY_CHARS} characters")
    return text.encode()


def edge_secret(edge_name: str, key: bytes | None = None) -> bytes:
    """The admin secret of the edge named `edge_name` (hex, as the edge reads it)."""
    digest = hmac.new(key or admin_key(), f"meridian-edge-admin:{edge_name}".encode(),
                      hashlib.sha256)
    return digest.hexdigest().encode()

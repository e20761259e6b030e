"""Authentication of the admin API: an HMAC-SHA256 of each request with a per-edge secret.

The caller (the control plane, a test, a bench) sends

    x-meridian-admin-auth: t=<unix seconds>,sig=<hex HMAC-SHA256(secret, message)>

where the message is `t`, the method and the path, each followed by a newline, then the
body's bytes. The edge checks the header's shape and the time (within `MAX_SKEW_S`) as soon
as the head arrives, before it reads the body, and the HMAC over the body before it parses a
byte of JSON. A signature covers one method and path, so a signed `GET /admin/table` cannot
be sent as a `PUT`; replaying a signed table within the window is harmless (the edge takes a
version only once).

The control plane derives each edge's secret from one key of its own
(`controlplane.routing.edge_secrets`), so it stores none; the edge reads its secret from a
file or the environment (`python -m edge --admin-secret-file`).
"""

from __future__ import annotations

import hashlib
import hmac
import time

HEADER = "x-meridian-admin-auth"
HEADER_BYTES = HEADER.encode()
MAX_SKEW_S = 300.0
MIN_SECRET_BYTES = 16


class AdminAuthError(Exception):
    """Why a request to the admin API is refused: the HTTP status, a code, the message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def _mac(secret: bytes, stamp: str, method: str, path: str, body: bytes) -> str:
    message = f"{stamp}\n{method}\n{path}\n".encode() + body
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, path: str, body: bytes = b"",
         now: float | None = None) -> str:
    """The header value for one request."""
    stamp = str(int(time.time() if now is None else now))
    return f"t={stamp},sig={_mac(secret, stamp, method, path, body)}"


def _fields(value: bytes | None) -> tuple[str, str]:
    if not value:
        raise AdminAuthError(401, "admin_auth_required",
                             f"The admin API needs the {HEADER} header: an HMAC of the "
                             "request with this edge's admin secret.")
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        text = ""
    parts: dict[str, str] = {}
    for part in text.split(","):
        name, _, given = part.strip().partition("=")
        parts[name] = given
    stamp, signature = parts.get("t", ""), parts.get("sig", "")
    if not stamp.isdigit() or len(signature) != 64:
        raise AdminAuthError(401, "admin_auth_malformed",
                             f"Malformed {HEADER} header: expected t=<unix seconds>,"
                             "sig=<64 hex digits>.")
    return stamp, signature


def check_head(headers: dict[bytes, bytes], now: float | None = None) -> None:
    """What can be checked before the body is read: the header's shape and its time."""
    stamp, _ = _fields(headers.get(HEADER_BYTES))
    skew = abs((time.time() if now is None else now) - int(stamp))
    if skew > MAX_SKEW_S:
        raise AdminAuthError(401, "admin_auth_expired",
                             f"The {HEADER} time is {skew:.0f} s away from this edge's "
                             f"clock; at most {MAX_SKEW_S:.0f} s is accepted.")


def verify(secret: bytes, method: str, path: str, headers: dict[bytes, bytes], body: bytes,
           now: float | None = None) -> None:
    """Raise AdminAuthError unless the request carries a fresh HMAC made with `secret`."""
    check_head(headers, now)
    stamp, signature = _fields(headers.get(HEADER_BYTES))
    if not hmac.compare_digest(signature, _mac(secret, stamp, method, path, body)):
        raise AdminAuthError(401, "admin_auth_invalid",
                             f"The {HEADER} signature does not match this request under "
                             "this edge's admin secret.")


def read_secret(text: str, source: str) -> bytes:
    """A secret from a file or the environment, stripped; too short is a start-up error."""
    secret = text.strip().encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{source}: the admin secret must be at least {MIN_SECRET_BYTES} "
                         f"bytes, got {len(secret)}")
    return secret

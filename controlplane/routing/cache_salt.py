"""Each tenant's prefix-cache salt, which the tables carry to the edges (edge/cache_salt.py).

salt = base64url(HMAC-SHA256(K, "tenant:<id>")), 43 characters (256 bits), where K is
HMAC-SHA256 of the table signing key's raw private bytes under a label of its own: a key
only the control plane holds, already configured wherever tables are signed, and used for
nothing else under this label. The tenant's id (not its name) is hashed, so a rename keeps
the salt and the engines' cached blocks.

Each tenant's salt is shipped rather than K itself: an edge can salt only the tenants its
table lists, a table read from an edge's disk gives away no tenant created later, and the
edge does no hashing per request. Rotating the signing key rotates every salt (the engines'
caches go cold once).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any

from cryptography.hazmat.primitives import serialization

from controlplane.deployments.models import Replica
from controlplane.routing.signing import signing_key

LABEL = b"meridian prefix-cache salt v1"


def salt_key() -> bytes:
    raw = signing_key().private_bytes(serialization.Encoding.Raw,
                                      serialization.PrivateFormat.Raw,
                                      serialization.NoEncryption())
    return hmac.new(raw, LABEL, hashlib.sha256).digest()


def tenant_cache_salt(tenant_id: int, key: bytes | None = None) -> str:
    digest = hmac.new(key or salt_key(), b"tenant:%d" % tenant_id, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def salted(body: dict[str, Any], salt: str) -> dict[str, Any]:
    """A request body with the tenant's salt, by the edge's rule (edge.cache_salt): a salt
    the client sent stays behind the tenant's, never in its place. For requests the control
    plane sends to a shared replica itself, past the edges (a batch's lines with no edge)."""
    own = body.get("cache_salt")
    return {**body, "cache_salt": f"{salt}.{own}" if isinstance(own, str) and own else salt}


def cache_isolated(replica: Replica) -> bool:
    """Whether requests to the replica carry their tenant's salt: as the edge decides it
    from the table (a shared deployment that did not opt into sharing its cache)."""
    deployment = replica.deployment
    return deployment.tenant_id is None and not deployment.shared_prefix_cache

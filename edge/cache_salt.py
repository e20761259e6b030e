"""Prefix-cache isolation between tenants: the `cache_salt` the edge gives each request.

vLLM keeps the KV blocks of prompts it has seen and reports how much of a new prompt it found
(`usage.prompt_tokens_details.cached_tokens`, and the time to first token). On a replica
that several tenants share, that is a way to test whether another tenant sent a given
prompt. vLLM's per-request `cache_salt` (a top-level field of a completion or chat request)
is mixed into the hash of the prompt's first block, and every later block's hash chains on
it, so requests with different salts never share a block.

The edge salts every request it sends to a replica of a shared deployment with the tenant's
salt (`TenantRules.cache_salt`, from the table), unless the deployment opted into a shared
prefix cache (`shared_prefix_cache`, for platform-wide system prompts); replicas dedicated
to one tenant need none. A salt the client sent is kept, behind the tenant's:
`<tenant salt>.<client salt>`. Tenant salts hold no `.`, so no choice of client salt makes
one tenant's value equal another's, and a tenant may still split its own cache by user.

Isolation rests on the edge choosing the salt's first part, not on the salt being secret:
a tenant that learns its own salt learns nothing about others'. The salts are kept secret
anyway (the table is platform-only), so that whoever reached an engine past the edges could
not salt a request as another tenant.
"""

from __future__ import annotations

import base64
import hashlib

import orjson

# What a tenant salt may hold: base64url, so it needs no escaping inside a JSON string and
# never holds the separator.
SALT_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
SALT_MIN_CHARS = 16
SALT_MAX_CHARS = 128
SEPARATOR = "."
# A client's own salt, at most this long (vLLM refuses salts past 1024 characters in some
# versions; the tenant's part and the separator must fit beside it).
CLIENT_SALT_MAX_CHARS = 256


def valid_tenant_salt(salt: str) -> bool:
    return SALT_MIN_CHARS <= len(salt) <= SALT_MAX_CHARS and all(
        char in SALT_ALPHABET for char in salt)


def fallback_salt(tenant: str) -> str:
    """A table that gives a tenant no salt (an older control plane, a hand-written table):
    one derived from the tenant's name. It isolates tenants just as well through the edge,
    but is not secret."""
    digest = hashlib.sha256(b"meridian cache salt\x00" + tenant.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def client_salt_problem(value: object) -> str:
    """Why a client's `cache_salt` is refused ("" when it is fine): vLLM's own rule (a
    non-empty string, or null) and a length the edge can prefix."""
    if value is None:
        return ""
    if not isinstance(value, str) or not value:
        return "Parameter 'cache_salt' must be a non-empty string if provided."
    if len(value) > CLIENT_SALT_MAX_CHARS:
        return (f"Parameter 'cache_salt' must be at most {CLIENT_SALT_MAX_CHARS} characters, "
                f"not {len(value)}.")
    return ""


def combined_salt(tenant_salt: str, client_salt: object) -> str:
    """The salt an engine is given: the tenant's, then the client's own if it sent one."""
    if isinstance(client_salt, str) and client_salt:
        return tenant_salt + SEPARATOR + client_salt
    return tenant_salt


def salted_body(body: bytes, tenant_salt: str, client_field: bool) -> bytes:
    """`body` (a JSON object the edge has parsed) with the tenant's salt.

    Without a `cache_salt` of the client's, the field is written in after the opening brace
    (the body is an object with at least `model`, and the salt needs no escaping), so the
    body is not encoded again. With one (`client_field`, null included), the body is parsed
    and encoded again with the two combined: a duplicate key would leave the choice to the
    engine's JSON parser.
    """
    if not client_field:
        start = body.find(b"{") + 1
        return b"".join((body[:start], b'"cache_salt":"', tenant_salt.encode(), b'",',
                         body[start:]))
    document = orjson.loads(body)
    document["cache_salt"] = combined_salt(tenant_salt, document.get("cache_salt"))
    return orjson.dumps(document)

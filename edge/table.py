"""Routing tables: canonical bytes, Ed25519 signatures, parsing, and last-known-good on disk.

A table is the JSON object of DESIGN §4. Its canonical form is the compact JSON encoding
with sorted keys (`canonical_bytes`); the signature is Ed25519 over the canonical bytes of
everything but `signature`. The control plane imports `canonical_bytes` and `sign_table`
from here so that both sides agree by construction; nothing in this module has side
effects at import.

Beyond the design's shape the edge reads these optional fields (defaults in brackets):

- replica: `tier` ["interactive"], `tenant` (a replica dedicated to one tenant) [none],
  `weight` [1.0], `rtt_ms` [0], `usd_per_mtok` [null], `max_inflight` [64], `state`
  ["ready"], `revision` (the deployment revision it runs) [none], `shared_prefix_cache`
  (its deployment lets tenants share its prefix cache: requests to it get no tenant
  `cache_salt`, `edge.cache_salt`) [false].
- model: `revisions` (`{"<revision id>": share}`, shares ≥ 0 with a positive total, read
  as percentages of the model's new conversations) [none: every replica takes traffic as
  before]. With it, every replica of the model names a listed `revision`; the edge sends a
  conversation to one revision by its prefix key (`edge.policy.pick_revision`).
  `batch_pool` (the tenants, or `["*"]`, whose batch-tier requests for the model go to its
  batch-tier replicas alone, also while it has none: `edge.policy.in_batch_pool`) [none:
  batch requests may use interactive replicas too].
- tenant: `regions` (narrows `jurisdictions` to these `cloud:region` keys) [[]],
  `models` [["*"]], `tier` ["interactive"], `resume_streams` (may a stream cut mid-way
  be resumed on another replica) [true], `cache_salt` (the tenant's prefix-cache salt:
  base64url, 16 to 128 characters) [one derived from the tenant's name].
- policy: `picker` ("max_score" | "round_robin" | "random") ["max_score"],
  `eject_max_s` [60], `queue_timeout_s` [2], `batch_queue_timeout_s` [30],
  `batch_max_share` (share of an interactive replica's `max_inflight` that batch requests
  may take) [0.5], `resume_streams_max` (resumptions per stream, 0 to 10; 0 turns
  resumption off) [2], `resume_deadline_s` (resumptions start within this many seconds of
  a stream's first cut) [30], `stream_stall_s` (a stream with no byte from its replica for
  this long counts as cut) [10], `first_byte_timeout_s` (a request whose replica has sent
  nothing of its answer this long after it was sent goes to another replica:
  `edge.first_byte`) [30], `max_table_age_s` (a table issued longer ago than this is stale)
  [86400], `stale_table_mode` (what a stale table means: "last_known_good" keeps serving it,
  "fail_closed" refuses every tenant but those marked `fail_open`) ["last_known_good"].
- tenant: `fail_open` (served from a stale table also under "fail_closed") [false].
- top-level `issued_at`: ISO 8601 with a UTC offset; a table without it counts as stale.
- top-level `revoked_keys`: sha256 hashes of keys revoked lately; the edge refuses them for
  good, whatever table it serves afterwards (`edge.revocations`) [[]].
- top-level `revoked_certificates`: serials (lower-case hex) of engine-CA certificates
  revoked and not yet expired; the edge neither presents nor accepts them
  (`edge.upstream_tls`) [[]].
- replica: `engine_key` (the replica's own engine API key, sent as its bearer token) [none],
  `tls_name` (the name its server certificate carries, checked instead of the URL's host)
  [the host].
- top-level `aliases`: `{"auto": {"rules": [{"max_prompt_tokens": 1000, "model": "small"}],
  "default": "large"}}`, or a plain `{"gpt-4o": "large"}`. Rules are tried in order; a rule
  may hold `max_prompt_tokens`, `min_prompt_tokens` and `tier`, and matches when all hold.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from edge.cache_salt import SALT_MAX_CHARS, SALT_MIN_CHARS, fallback_salt, valid_tenant_salt
from edge.keys import public_key_id

TABLE_FILE = "table.json"
KNOWN_SCORERS = ("latency", "load", "prefix", "cost")
KNOWN_PICKERS = ("max_score", "round_robin", "random")
TIERS = ("interactive", "batch")
STALE_MODES = ("last_known_good", "fail_closed")
DEFAULT_MAX_TABLE_AGE_S = 24 * 3600.0
# States a replica may be listed in; only these two take new requests.
ROUTABLE_STATES = frozenset({"ready", "degraded"})
KNOWN_STATES = ROUTABLE_STATES | {"draining"}


class TableError(ValueError):
    """A table that cannot be accepted; `field` names where, the message says why."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class SignatureError(TableError):
    """A missing, malformed or wrong signature."""


def canonical_bytes(table: Mapping[str, Any]) -> bytes:
    """Compact JSON with sorted keys, UTF-8: the one encoding both sides hash and sign.

    It encodes exactly what it is given; `signing_bytes` drops `signature` first.
    """
    return json.dumps(
        table, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def signing_bytes(table: Mapping[str, Any]) -> bytes:
    """The bytes the signature covers: the canonical form of everything but `signature`."""
    return canonical_bytes({k: v for k, v in table.items() if k != "signature"})


def table_hash(table: Mapping[str, Any]) -> str:
    """sha256 of the canonical form of the whole signed table (the pull API's ETag)."""
    return hashlib.sha256(canonical_bytes(table)).hexdigest()


def sign_table(table: Mapping[str, Any], private_key: Ed25519PrivateKey) -> dict[str, Any]:
    """A copy of `table` with `signature` set (base64 Ed25519 over `signing_bytes`)."""
    unsigned = {k: v for k, v in table.items() if k != "signature"}
    signature = private_key.sign(signing_bytes(unsigned))
    return {**unsigned, "signature": base64.b64encode(signature).decode()}


def verify_table(table: Mapping[str, Any],
                 public_keys: Ed25519PublicKey | Iterable[Ed25519PublicKey]) -> None:
    """Raise SignatureError unless one of `public_keys` signed `table`."""
    keys = [public_keys] if isinstance(public_keys, Ed25519PublicKey) else list(public_keys)
    signature = table.get("signature")
    if not isinstance(signature, str) or not signature:
        raise SignatureError("the table is not signed", "signature")
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("the signature is not base64", "signature") from None
    if len(raw) != 64:
        raise SignatureError("the signature is not 64 bytes of Ed25519", "signature")
    payload = signing_bytes(table)
    # Try the key the table names first, so a rotation with two keys costs one check.
    key_id = table.get("key_id")
    keys.sort(key=lambda k: public_key_id(k) != key_id)
    for key in keys:
        try:
            key.verify(raw, payload)
            return
        except InvalidSignature:
            continue
    raise SignatureError("the signature does not match the table under any trusted key",
                         "signature")


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a replica listens: what the connection pool keys connections by."""

    scheme: str
    host: str
    port: int
    base_path: bytes  # prefix for request paths, e.g. b"" or b"/engine-3"
    host_header: bytes  # the Host header value
    # (scheme, host, port): what the pool files idle connections under, made once here
    # rather than as a new tuple on every take and release.
    key: tuple[str, str, int]
    # The name the replica's certificate must carry (the table's `tls_name`), else the host.
    server_name: str = ""


def parse_origin(url: str, where: str = "url", server_name: str | None = None) -> Origin:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TableError(f"expected an http(s) URL, got {url!r}", where)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise TableError(f"bad port in {url!r}", where) from None
    default = 443 if parts.scheme == "https" else 80
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    host_header = host if port == default else f"{host}:{port}"
    return Origin(parts.scheme, parts.hostname, port, parts.path.rstrip("/").encode(),
                  host_header.encode(), (parts.scheme, parts.hostname, port),
                  server_name or parts.hostname)


@dataclass(frozen=True, slots=True)
class Replica:
    id: str
    model: str
    url: str
    origin: Origin
    region: str
    jurisdiction: str
    weight: float = 1.0
    rtt_ms: float = 0.0
    usd_per_mtok: float | None = None
    max_inflight: int = 64
    state: str = "ready"
    tier: str = "interactive"
    tenant: str | None = None
    revision: str | None = None
    shared_prefix_cache: bool = False
    # `authorization: Bearer <engine_key>\r\n`, made once here; b"" without a key.
    engine_authorization: bytes = b""

    @property
    def cache_isolated(self) -> bool:
        """Whether requests to it carry their tenant's `cache_salt`: it serves several
        tenants (no dedicated `tenant`) and its deployment did not opt into sharing."""
        return self.tenant is None and not self.shared_prefix_cache


@dataclass(frozen=True, slots=True)
class TenantRules:
    tenant: str
    jurisdictions: frozenset[str]
    regions: frozenset[str] = frozenset()
    rpm: int = 0
    tpm: int = 0
    models: frozenset[str] = frozenset({"*"})
    tier: str = "interactive"
    resume_streams: bool = True
    fail_open: bool = False
    cache_salt: str = ""

    def may_use_model(self, model: str) -> bool:
        return "*" in self.models or model in self.models

    def may_use_replica(self, replica: Replica) -> bool:
        """Residency and dedication: the rule every pick must satisfy, whatever else holds."""
        if "*" not in self.jurisdictions and replica.jurisdiction not in self.jurisdictions:
            return False
        if self.regions and replica.region not in self.regions:
            return False
        return replica.tenant is None or replica.tenant == self.tenant


@dataclass(frozen=True, slots=True)
class Policy:
    scorers: Mapping[str, float] = field(
        default_factory=lambda: {"latency": 1.0, "load": 2.0, "prefix": 3.0, "cost": 0.5}
    )
    picker: str = "max_score"
    retry_before_first_byte: int = 2
    eject_after_failures: int = 2
    eject_base_s: float = 1.0
    eject_max_s: float = 60.0
    queue_timeout_s: float = 2.0
    batch_queue_timeout_s: float = 30.0
    batch_max_share: float = 0.5
    resume_streams_max: int = 2
    resume_deadline_s: float = 30.0
    stream_stall_s: float = 10.0
    first_byte_timeout_s: float = 30.0
    max_table_age_s: float = DEFAULT_MAX_TABLE_AGE_S
    stale_table_mode: str = "last_known_good"


MAX_RESUMPTIONS = 10


@dataclass(frozen=True, slots=True)
class AliasRule:
    model: str
    max_prompt_tokens: int | None = None
    min_prompt_tokens: int | None = None
    tier: str | None = None

    def matches(self, prompt_tokens: int, tier: str) -> bool:
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return False
        if self.min_prompt_tokens is not None and prompt_tokens < self.min_prompt_tokens:
            return False
        return self.tier is None or self.tier == tier


@dataclass(frozen=True, slots=True)
class Alias:
    name: str
    rules: tuple[AliasRule, ...]
    default: str

    def resolve(self, prompt_tokens: int, tier: str) -> str:
        for rule in self.rules:
            if rule.matches(prompt_tokens, tier):
                return rule.model
        return self.default


@dataclass(frozen=True)
class RoutingTable:
    """A verified table, parsed into what the hot path reads."""

    version: int
    edge: str
    issued_at: str
    key_id: str
    hash: str
    models: Mapping[str, tuple[Replica, ...]]
    tenants: Mapping[str, TenantRules]
    policy: Policy
    aliases: Mapping[str, Alias]
    document: Mapping[str, Any]
    # Per model with a traffic split: (revision id, share) pairs, newest revision first
    # (the highest id: a canary takes the low end of [0, 100), so growing its share never
    # moves a conversation off it).
    revisions: Mapping[str, tuple[tuple[str, float], ...]] = field(default_factory=dict)
    # Per model with a batch-tier deployment: the tenants whose batch requests go to its
    # batch-tier replicas alone ("*": everyone's), also while it has none.
    batch_pools: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # `issued_at` as seconds since the epoch (0: the table did not say, so it is stale).
    issued_at_s: float = 0.0
    revoked_keys: frozenset[str] = frozenset()
    revoked_certificates: frozenset[str] = frozenset()

    @property
    def expires_at(self) -> float:
        """When (seconds since the epoch) this table becomes stale."""
        return self.issued_at_s + self.policy.max_table_age_s

    @property
    def replicas(self) -> list[Replica]:
        return [r for replicas in self.models.values() for r in replicas]


_REQUIRED: Any = object()
_KINDS: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "number": (int, float), "object": (dict,),
}


def _get(obj: Mapping[str, Any], key: str, kind: str, where: str,
         default: Any = _REQUIRED) -> Any:
    """obj[key] checked against `kind`; a missing or null optional key gives `default`."""
    value = obj.get(key)
    if value is None:
        if default is _REQUIRED:
            raise TableError(f"{where}.{key} is required", f"{where}.{key}")
        return default
    if isinstance(value, bool) or not isinstance(value, _KINDS[kind]):
        raise TableError(f"{where}.{key} must be {'an' if kind[0] in 'io' else 'a'} {kind}",
                         f"{where}.{key}")
    return float(value) if kind == "number" else value  # type: ignore[arg-type]


def _flag(obj: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TableError(f"{where}.{key} must be true or false, not {value!r}", f"{where}.{key}")
    return value


def _strings(value: Any, where: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TableError(f"{where} must be a list of strings", where)
    return frozenset(value)


def _replica(model: str, i: int, entry: Any) -> Replica:
    where = f"models.{model}.replicas[{i}]"
    if not isinstance(entry, dict):
        raise TableError(f"{where} must be an object", where)
    url = _get(entry, "url", "str", where)
    state = _get(entry, "state", "str", where, "ready")
    if state not in KNOWN_STATES:
        raise TableError(f"{where}.state must be one of {sorted(KNOWN_STATES)}", f"{where}.state")
    tier = _get(entry, "tier", "str", where, "interactive")
    if tier not in TIERS:
        raise TableError(f"{where}.tier must be one of {list(TIERS)}", f"{where}.tier")
    max_inflight = _get(entry, "max_inflight", "int", where, 64)
    if max_inflight < 1:
        raise TableError(f"{where}.max_inflight must be at least 1", f"{where}.max_inflight")
    weight = _get(entry, "weight", "number", where, 1.0)
    if weight < 0:
        raise TableError(f"{where}.weight must be ≥ 0", f"{where}.weight")
    return Replica(
        id=_get(entry, "id", "str", where),
        model=model,
        url=url,
        origin=parse_origin(url, f"{where}.url", _get(entry, "tls_name", "str", where, None)),
        region=_get(entry, "region", "str", where),
        jurisdiction=_get(entry, "jurisdiction", "str", where),
        weight=weight,
        rtt_ms=max(0.0, _get(entry, "rtt_ms", "number", where, 0.0)),
        usd_per_mtok=_get(entry, "usd_per_mtok", "number", where, None),
        max_inflight=max_inflight,
        state=state,
        tier=tier,
        tenant=_get(entry, "tenant", "str", where, None),
        revision=_get(entry, "revision", "str", where, None),
        engine_authorization=_engine_authorization(entry, where),
        shared_prefix_cache=_flag(entry, "shared_prefix_cache", where, False),
    )


def revision_order(revision: str) -> tuple[int, str]:
    """Sort key for revision ids, numeric ones by value."""
    return (len(revision), revision) if revision.isdigit() else (1 << 30, revision)


def _revisions(model: str, entry: Any, replicas: tuple[Replica, ...]
               ) -> tuple[tuple[str, float], ...]:
    where = f"models.{model}.revisions"
    if not isinstance(entry, dict) or not entry:
        raise TableError(f"{where} must be a non-empty object of revision shares", where)
    shares: list[tuple[str, float]] = []
    for revision, share in entry.items():
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not (
                0 <= share <= 100):
            raise TableError(f"{where}.{revision} must be a share within [0, 100], not "
                             f"{share!r}", f"{where}.{revision}")
        shares.append((revision, float(share)))
    if not sum(share for _, share in shares) > 0:
        raise TableError(f"{where}: at least one revision needs a share > 0", where)
    for i, replica in enumerate(replicas):
        if replica.revision is None or replica.revision not in entry:
            raise TableError(f"models.{model}.replicas[{i}].revision must name one of "
                             f"{sorted(entry)}, not {replica.revision!r}",
                             f"models.{model}.replicas[{i}].revision")
    shares.sort(key=lambda pair: revision_order(pair[0]), reverse=True)
    return tuple(shares)


def _tenant(key_hash: str, entry: Any) -> TenantRules:
    where = f"tenants.{key_hash[:12]}"
    if not isinstance(entry, dict):
        raise TableError(f"{where} must be an object", where)
    tier = _get(entry, "tier", "str", where, "interactive")
    if tier not in TIERS:
        raise TableError(f"{where}.tier must be one of {list(TIERS)}", f"{where}.tier")
    rpm = _get(entry, "rpm", "int", where, 0)
    tpm = _get(entry, "tpm", "int", where, 0)
    if rpm < 0 or tpm < 0:
        raise TableError(f"{where}: rpm and tpm must be ≥ 0 (0 means unlimited)", where)
    return TenantRules(
        tenant=_get(entry, "tenant", "str", where),
        jurisdictions=_strings(entry.get("jurisdictions"), f"{where}.jurisdictions"),
        regions=_strings(entry.get("regions", []), f"{where}.regions"),
        rpm=rpm,
        tpm=tpm,
        models=_strings(entry.get("models", ["*"]), f"{where}.models"),
        tier=tier,
        resume_streams=_flag(entry, "resume_streams", where, True),
        fail_open=_flag(entry, "fail_open", where, False),
        cache_salt=_cache_salt(entry, where),
    )


def _cache_salt(entry: Mapping[str, Any], where: str) -> str:
    salt = _get(entry, "cache_salt", "str", where, None)
    if salt is None:
        return fallback_salt(_get(entry, "tenant", "str", where))
    if not valid_tenant_salt(salt):
        raise TableError(f"{where}.cache_salt must be {SALT_MIN_CHARS} to {SALT_MAX_CHARS} "
                         "base64url characters", f"{where}.cache_salt")
    return salt


def _policy(entry: Any) -> Policy:
    if entry is None:
        return Policy()
    if not isinstance(entry, dict):
        raise TableError("policy must be an object", "policy")
    defaults = Policy()
    scorers = entry.get("scorers", defaults.scorers)
    if not isinstance(scorers, dict):
        raise TableError("policy.scorers must be an object", "policy.scorers")
    for name, weight in scorers.items():
        if name not in KNOWN_SCORERS:
            raise TableError(f"unknown scorer {name!r}; known: {', '.join(KNOWN_SCORERS)}",
                             f"policy.scorers.{name}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise TableError(f"policy.scorers.{name} must be a number ≥ 0",
                             f"policy.scorers.{name}")
    picker = _get(entry, "picker", "str", "policy", defaults.picker)
    if picker not in KNOWN_PICKERS:
        raise TableError(f"policy.picker must be one of {list(KNOWN_PICKERS)}", "policy.picker")
    policy = Policy(
        scorers={name: float(weight) for name, weight in scorers.items()},
        picker=picker,
        retry_before_first_byte=_get(entry, "retry_before_first_byte", "int", "policy",
                                     defaults.retry_before_first_byte),
        eject_after_failures=_get(entry, "eject_after_failures", "int", "policy",
                                  defaults.eject_after_failures),
        eject_base_s=_get(entry, "eject_base_s", "number", "policy", defaults.eject_base_s),
        eject_max_s=_get(entry, "eject_max_s", "number", "policy", defaults.eject_max_s),
        queue_timeout_s=_get(entry, "queue_timeout_s", "number", "policy",
                             defaults.queue_timeout_s),
        batch_queue_timeout_s=_get(entry, "batch_queue_timeout_s", "number", "policy",
                                   defaults.batch_queue_timeout_s),
        batch_max_share=_get(entry, "batch_max_share", "number", "policy",
                             defaults.batch_max_share),
        resume_streams_max=_get(entry, "resume_streams_max", "int", "policy",
                                defaults.resume_streams_max),
        resume_deadline_s=_get(entry, "resume_deadline_s", "number", "policy",
                               defaults.resume_deadline_s),
        stream_stall_s=_get(entry, "stream_stall_s", "number", "policy",
                            defaults.stream_stall_s),
        first_byte_timeout_s=_get(entry, "first_byte_timeout_s", "number", "policy",
                                  defaults.first_byte_timeout_s),
        max_table_age_s=_get(entry, "max_table_age_s", "number", "policy",
                             defaults.max_table_age_s),
        stale_table_mode=_get(entry, "stale_table_mode", "str", "policy",
                              defaults.stale_table_mode),
    )
    if policy.retry_before_first_byte < 0 or policy.eject_after_failures < 1:
        raise TableError("policy: retries must be ≥ 0 and eject_after_failures ≥ 1", "policy")
    if policy.eject_base_s <= 0 or policy.eject_max_s < policy.eject_base_s:
        raise TableError("policy: need 0 < eject_base_s ≤ eject_max_s", "policy.eject_base_s")
    if not 0 <= policy.batch_max_share <= 1:
        raise TableError("policy.batch_max_share must be within [0, 1]", "policy.batch_max_share")
    if not 0 <= policy.resume_streams_max <= MAX_RESUMPTIONS:
        raise TableError(f"policy.resume_streams_max must be within [0, {MAX_RESUMPTIONS}] "
                         f"(0 turns resumption off), not {policy.resume_streams_max}",
                         "policy.resume_streams_max")
    if not policy.resume_deadline_s > 0:
        raise TableError(f"policy.resume_deadline_s must be > 0 seconds, not "
                         f"{policy.resume_deadline_s}", "policy.resume_deadline_s")
    if not policy.stream_stall_s > 0:
        raise TableError(f"policy.stream_stall_s must be > 0 seconds, not "
                         f"{policy.stream_stall_s}", "policy.stream_stall_s")
    if not policy.first_byte_timeout_s > 0:
        raise TableError(f"policy.first_byte_timeout_s must be > 0 seconds, not "
                         f"{policy.first_byte_timeout_s}", "policy.first_byte_timeout_s")
    if not policy.max_table_age_s > 0:
        raise TableError(f"policy.max_table_age_s must be > 0 seconds, not "
                         f"{policy.max_table_age_s}", "policy.max_table_age_s")
    if policy.stale_table_mode not in STALE_MODES:
        raise TableError(f"policy.stale_table_mode must be one of {list(STALE_MODES)}, not "
                         f"{policy.stale_table_mode!r}", "policy.stale_table_mode")
    return policy


def parse_issued_at(value: Any) -> float:
    """`issued_at` (ISO 8601 with a UTC offset) as seconds since the epoch; 0.0 when absent."""
    if value is None or value == "":
        return 0.0
    if not isinstance(value, str):
        raise TableError("table.issued_at must be an ISO 8601 time", "issued_at")
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise TableError(f"table.issued_at must be an ISO 8601 time, not {value!r}",
                         "issued_at") from None
    if when.tzinfo is None:
        raise TableError(f"table.issued_at must carry a UTC offset, not {value!r}",
                         "issued_at")
    return when.timestamp()


def parse_revoked_keys(value: Any) -> frozenset[str]:
    """`revoked_keys`: sha256 hex digests of API keys."""
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(
            isinstance(v, str) and len(v) == 64 for v in value):
        raise TableError("revoked_keys must be a list of sha256 hex digests", "revoked_keys")
    return frozenset(value)


def parse_revoked_certificates(value: Any) -> frozenset[str]:
    """`revoked_certificates`: certificate serials, lower-case hex."""
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(
            isinstance(v, str) and 0 < len(v) <= 40
            and all(c in "0123456789abcdef" for c in v) for v in value):
        raise TableError("revoked_certificates must be a list of certificate serials "
                         "(lower-case hex)", "revoked_certificates")
    return frozenset(value)


def _engine_authorization(entry: Mapping[str, Any], where: str) -> bytes:
    key = _get(entry, "engine_key", "str", where, "")
    if not key:
        return b""
    if not all(33 <= ord(c) < 127 for c in key) or len(key) > 256:
        raise TableError(f"{where}.engine_key must be 1-256 printable ASCII characters, no "
                         "spaces", f"{where}.engine_key")
    return b"authorization: Bearer %s\r\n" % key.encode()


def _alias(name: str, entry: Any) -> Alias:
    where = f"aliases.{name}"
    if isinstance(entry, str):
        if not entry:
            raise TableError(f"{where} must name a model", where)
        return Alias(name, (), entry)
    if not isinstance(entry, dict):
        raise TableError(f"{where} must be a model name or an object with rules", where)
    rules = entry.get("rules", [])
    if not isinstance(rules, list):
        raise TableError(f"{where}.rules must be a list", f"{where}.rules")
    parsed = []
    for i, rule in enumerate(rules):
        rwhere = f"{where}.rules[{i}]"
        if not isinstance(rule, dict):
            raise TableError(f"{rwhere} must be an object", rwhere)
        unknown = set(rule) - {"model", "max_prompt_tokens", "min_prompt_tokens", "tier"}
        if unknown:
            raise TableError(f"{rwhere} has unknown condition(s) {sorted(unknown)}", rwhere)
        parsed_rule = AliasRule(
            model=_get(rule, "model", "str", rwhere),
            max_prompt_tokens=_get(rule, "max_prompt_tokens", "int", rwhere, None),
            min_prompt_tokens=_get(rule, "min_prompt_tokens", "int", rwhere, None),
            tier=_get(rule, "tier", "str", rwhere, None),
        )
        if not parsed_rule.model:
            raise TableError(f"{rwhere}.model must name a model", f"{rwhere}.model")
        for bound in (parsed_rule.max_prompt_tokens, parsed_rule.min_prompt_tokens):
            if bound is not None and bound < 0:
                raise TableError(f"{rwhere}: prompt token bounds must be ≥ 0", rwhere)
        if parsed_rule.tier is not None and parsed_rule.tier not in TIERS:
            raise TableError(f"{rwhere}.tier must be one of {list(TIERS)}", f"{rwhere}.tier")
        parsed.append(parsed_rule)
    unknown = set(entry) - {"rules", "default"}
    if unknown:
        raise TableError(f"{where} has unknown key(s) {sorted(unknown)}", where)
    default = _get(entry, "default", "str", where)
    if not default:
        raise TableError(f"{where}.default must name a model", f"{where}.default")
    return Alias(name, tuple(parsed), default)


def _batch_pool(model: str, pool: Any) -> frozenset[str]:
    if not isinstance(pool, list) or not pool or not all(
            isinstance(name, str) and name for name in pool):
        raise TableError(f"models.{model}.batch_pool must be a non-empty list of tenant names "
                         "or [\"*\"]", f"models.{model}.batch_pool")
    return frozenset(pool)


def parse_aliases(document: Any) -> dict[str, Alias]:
    """The `aliases` object, by the rules the edge applies (the control plane checks what it
    saves with this too)."""
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise TableError("aliases must be an object of alias → model or rules", "aliases")
    aliases = {}
    for name, entry in document.items():
        if not isinstance(name, str) or not name or len(name) > 200:
            raise TableError(f"alias name {name!r} must be 1 to 200 characters", "aliases")
        aliases[name] = _alias(name, entry)
    return aliases


def parse_table(document: Mapping[str, Any]) -> RoutingTable:
    """Check the shape of a (verified) table and build what the hot path reads."""
    if not isinstance(document, Mapping):
        raise TableError("a table must be a JSON object")
    version = _get(document, "version", "int", "table")
    if version < 0:
        raise TableError("table.version must be ≥ 0", "version")
    models_doc = _get(document, "models", "object", "table", {})
    models: dict[str, tuple[Replica, ...]] = {}
    revisions: dict[str, tuple[tuple[str, float], ...]] = {}
    batch_pools: dict[str, frozenset[str]] = {}
    for model, entry in models_doc.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("replicas", []), list):
            raise TableError(f"models.{model} must be {{\"replicas\": [...]}}", f"models.{model}")
        replicas = tuple(_replica(model, i, r) for i, r in enumerate(entry.get("replicas", [])))
        ids = [r.id for r in replicas]
        if len(set(ids)) != len(ids):
            raise TableError(f"models.{model} lists a replica id twice", f"models.{model}")
        models[model] = replicas
        if entry.get("revisions") is not None:
            revisions[model] = _revisions(model, entry["revisions"], replicas)
        if entry.get("batch_pool") is not None:
            batch_pools[model] = _batch_pool(model, entry["batch_pool"])
    tenants_doc = _get(document, "tenants", "object", "table", {})
    tenants = {key_hash: _tenant(key_hash, entry) for key_hash, entry in tenants_doc.items()}
    aliases = parse_aliases(_get(document, "aliases", "object", "table", {}))
    for name in aliases:
        if name in models:
            raise TableError(f"alias {name!r} shadows a model of the same name", f"aliases.{name}")
    return RoutingTable(
        version=version,
        edge=_get(document, "edge", "str", "table", ""),
        issued_at=_get(document, "issued_at", "str", "table", ""),
        key_id=_get(document, "key_id", "str", "table", ""),
        hash=table_hash(document),
        models=models,
        tenants=tenants,
        policy=_policy(document.get("policy")),
        aliases=aliases,
        document=document,
        revisions=revisions,
        batch_pools=batch_pools,
        issued_at_s=parse_issued_at(document.get("issued_at")),
        revoked_keys=parse_revoked_keys(document.get("revoked_keys")),
        revoked_certificates=parse_revoked_certificates(document.get("revoked_certificates")),
    )


def verified_document(body: bytes, public_keys: Iterable[Ed25519PublicKey]) -> dict[str, Any]:
    """Parse JSON bytes and verify the signature; the shape is not checked yet."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TableError(f"the table is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise TableError("a table must be a JSON object")
    verify_table(document, public_keys)
    return document


def load_verified(body: bytes, public_keys: Iterable[Ed25519PublicKey]) -> RoutingTable:
    """Parse JSON bytes, verify the signature, then check the shape."""
    return parse_table(verified_document(body, public_keys))


def save_last_known_good(state_dir: str | Path, table: RoutingTable) -> Path:
    """Write the table to `state_dir/table.json` so that a crash leaves the old or the new one.

    Temp file in the same directory, fsync, rename over, fsync the directory.
    """
    directory = Path(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / TABLE_FILE
    fd, temp = tempfile.mkstemp(prefix=".table-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(canonical_bytes(table.document))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def load_last_known_good(
    state_dir: str | Path, public_keys: Iterable[Ed25519PublicKey]
) -> RoutingTable | None:
    """The table saved in `state_dir`, verified again (the disk is not trusted), or None."""
    path = Path(state_dir) / TABLE_FILE
    try:
        body = path.read_bytes()
    except FileNotFoundError:
        return None
    return load_verified(body, list(public_keys))


def with_tenants(table: RoutingTable, tenants: Mapping[str, TenantRules]) -> RoutingTable:
    """The same table serving only `tenants` (keys revoked since it was signed are left out)."""
    return RoutingTable(
        version=table.version, edge=table.edge, issued_at=table.issued_at,
        key_id=table.key_id, hash=table.hash, models=table.models, tenants=tenants,
        policy=table.policy, aliases=table.aliases, document=table.document,
        revisions=table.revisions, batch_pools=table.batch_pools,
        issued_at_s=table.issued_at_s, revoked_keys=table.revoked_keys,
        revoked_certificates=table.revoked_certificates,
    )

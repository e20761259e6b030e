"""The routing table's types: what the edge's hot path reads from a parsed table.

`RoutingTable` holds each model's replicas (`Replica`, with its `Origin`), the tenants'
rules (`TenantRules`), the scheduling `Policy` and the aliases (`Alias`); `TableError` says
why a table cannot be accepted. Parsing is `edge.table_fields` and `edge.table.parse_table`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

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

    def may_know(self, replicas: tuple[Replica, ...], pool: frozenset[str] | None) -> bool:
        """Whether a served model is there at all for this tenant: one of its replicas is
        shared or this tenant's, or its batch pool is open to it. A model that only another
        tenant's dedicated replicas serve is, to this tenant, a model that does not exist
        (a 404 like any unknown name, never a 503 that would confirm it)."""
        for replica in replicas:
            if replica.tenant is None or replica.tenant == self.tenant:
                return True
        return pool is not None and ("*" in pool or self.tenant in pool)


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

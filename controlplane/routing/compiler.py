"""Compiles one edge's routing table (DESIGN §4) from plain views of the database. Pure.

The service layer (routing/services.py) loads rows into these views; this module decides
what an edge may see: which replicas, with which weight, at what network distance and price,
and which tenants' key hashes with their rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from regions.geo import great_circle_km, rtt_ms

# Draining replicas stay in the table with weight 0 so in-flight streams finish, but new
# requests go elsewhere; degraded ones take a reduced share.
STATE_WEIGHT = {"ready": 1.0, "degraded": 0.5, "draining": 0.0}


@dataclass(frozen=True)
class EdgeView:
    name: str
    region: str
    latitude: float
    longitude: float


@dataclass(frozen=True)
class ReplicaView:
    id: str
    model: str
    region: str
    jurisdiction: str
    latitude: float
    longitude: float
    state: str
    url: str
    urls_by_region: Mapping[str, str] = field(default_factory=dict)
    usd_per_mtok: float | None = None
    max_inflight: int = 64
    tier: str = "interactive"
    tenant: str | None = None
    # Set only while the replica's deployment splits its traffic between revisions (a
    # rollout in progress): the replica's revision id, and each revision's share (%).
    revision: str | None = None
    revision_shares: Mapping[str, float] | None = None
    # A rollout in waves: the shares at edges in these regions (edge region → shares);
    # edges elsewhere take `revision_shares`.
    revision_shares_by_region: Mapping[str, Mapping[str, float]] | None = None
    # A shared deployment that lets tenants share its prefix cache: requests to it carry
    # no tenant cache_salt (edge/cache_salt.py).
    shared_prefix_cache: bool = False
    # The replica's own engine API key (core/engine_keys.py), and the name its server
    # certificate carries, which edges check instead of the URL's host (core/certificates).
    engine_key: str = ""
    tls_name: str = ""


@dataclass(frozen=True)
class TenantKeyView:
    key_hash: str
    tenant: str
    jurisdictions: tuple[str, ...]
    regions: tuple[str, ...]
    rpm: int
    tpm: int
    models: tuple[str, ...]
    tier: str
    resume_streams: bool = True
    # The tenant's prefix-cache salt (routing/cache_salt.py); "" leaves it to the edge's
    # fallback.
    cache_salt: str = ""


@dataclass(frozen=True)
class PolicyView:
    scorers: Mapping[str, float]
    retry_before_first_byte: int
    eject_after_failures: int
    eject_base_s: float
    aliases: Mapping[str, Any] = field(default_factory=dict)
    resume_streams_max: int = 2
    resume_deadline_s: float = 30.0
    stream_stall_s: float = 10.0
    first_byte_timeout_s: float = 30.0
    max_table_age_s: float = 24 * 3600.0
    stale_table_mode: str = "last_known_good"
    # Tenants an edge still serves from a stale table under "fail_closed".
    fail_open_tenants: frozenset[str] = frozenset()


def replica_entry(edge: EdgeView, replica: ReplicaView) -> dict[str, Any]:
    km = great_circle_km(edge.latitude, edge.longitude, replica.latitude, replica.longitude)
    entry: dict[str, Any] = {
        "id": replica.id,
        "url": replica.urls_by_region.get(edge.region, replica.url),
        "region": replica.region,
        "jurisdiction": replica.jurisdiction,
        "weight": STATE_WEIGHT[replica.state],
        "rtt_ms": round(rtt_ms(km), 2),
        "usd_per_mtok": None if replica.usd_per_mtok is None else round(replica.usd_per_mtok, 4),
        "max_inflight": replica.max_inflight,
        "state": replica.state,
        "tier": replica.tier,
    }
    if replica.tenant is not None:
        entry["tenant"] = replica.tenant
    if replica.revision is not None:
        entry["revision"] = replica.revision
    if replica.shared_prefix_cache and replica.tenant is None:
        entry["shared_prefix_cache"] = True
    if replica.engine_key:
        entry["engine_key"] = replica.engine_key
    if replica.tls_name:
        entry["tls_name"] = replica.tls_name
    return entry


SHARED_POOL = "*"


def compile_table(
    edge: EdgeView,
    replicas: Iterable[ReplicaView],
    keys: Iterable[TenantKeyView],
    policy: PolicyView,
    *,
    version: int,
    issued_at: str,
    key_id: str,
    batch_pools: Mapping[str, Iterable[str | None]] | None = None,
    revoked_keys: Iterable[str] = (),
    revoked_certificates: Iterable[str] = (),
) -> dict[str, Any]:
    """The unsigned table for `edge`; sign it with routing.signing.sign_table.

    `batch_pools`: per served model name, the tenants of its batch-tier deployments (None
    for a shared one). Such a model's entry says `batch_pool`: whose batch-tier requests go
    to its batch-tier replicas only (`"*"`: everyone's), never to its interactive ones; the
    entry is there even while the pool has no replica (scaled to zero), so that the edge
    answers those requests 503 and counts them, which is what wakes the pool."""
    models = _model_entries(edge, replicas, batch_pools or {})
    tenants = _tenant_entries(keys, policy)
    certificates = sorted(revoked_certificates)
    return {
        # Engine-CA certificates revoked and not yet expired: edges neither present nor
        # accept them (edge/upstream_tls.py).
        **({"revoked_certificates": certificates} if certificates else {}),
        "version": version,
        "issued_at": issued_at,
        "edge": edge.name,
        "key_id": key_id,
        "models": models,
        "tenants": tenants,
        "aliases": dict(policy.aliases),
        # Keys revoked lately: an edge refuses them for good, whatever table it serves later.
        "revoked_keys": sorted(revoked_keys),
        "policy": _policy_entry(policy),
    }


def _model_entries(edge: EdgeView, replicas: Iterable[ReplicaView],
                   batch_pools: Mapping[str, Iterable[str | None]]) -> dict[str, dict[str, Any]]:
    """Each served model's replicas as `edge` sees them, its revision split and batch pool."""
    models: dict[str, dict[str, Any]] = {}
    for model, owners in batch_pools.items():
        names = {SHARED_POOL if owner is None else owner for owner in owners}
        if names:
            pool = [SHARED_POOL] if SHARED_POOL in names else sorted(names)
            models[model] = {"replicas": [], "batch_pool": pool}
    for replica in sorted(replicas, key=lambda r: (r.model, r.id)):
        if replica.state not in STATE_WEIGHT:
            continue
        entry = models.setdefault(replica.model, {"replicas": []})
        entry["replicas"].append(replica_entry(edge, replica))
        if replica.revision_shares is not None:
            # Revision weights: each revision's share of the model's new conversations (at
            # this edge, for a rollout in waves).
            given = replica.revision_shares
            if replica.revision_shares_by_region:
                given = replica.revision_shares_by_region.get(edge.region, given)
            shares = entry.setdefault("revisions", {})
            for revision, share in given.items():
                shares[revision] = float(share)
    for entry in models.values():
        if "revisions" in entry:
            # A replica outside the split (none should be) takes no new conversations.
            for replica_entry_ in entry["replicas"]:
                replica_entry_.setdefault("revision", "")
                entry["revisions"].setdefault(replica_entry_["revision"], 0.0)
    return models


def _tenant_entries(keys: Iterable[TenantKeyView], policy: PolicyView) -> dict[str, Any]:
    """Each API key's hash with its tenant's rules."""
    return {
        key.key_hash: {
            "tenant": key.tenant,
            "jurisdictions": sorted(key.jurisdictions),
            "regions": sorted(key.regions),
            "rpm": key.rpm,
            "tpm": key.tpm,
            "models": sorted(key.models) or ["*"],
            "tier": key.tier,
            "resume_streams": key.resume_streams,
            **({"fail_open": True} if key.tenant in policy.fail_open_tenants else {}),
            **({"cache_salt": key.cache_salt} if key.cache_salt else {}),
        }
        for key in keys
    }


def _policy_entry(policy: PolicyView) -> dict[str, Any]:
    return {
        "scorers": dict(policy.scorers),
        "retry_before_first_byte": policy.retry_before_first_byte,
        "eject_after_failures": policy.eject_after_failures,
        "eject_base_s": policy.eject_base_s,
        "resume_streams_max": policy.resume_streams_max,
        "resume_deadline_s": policy.resume_deadline_s,
        "stream_stall_s": policy.stream_stall_s,
        "first_byte_timeout_s": policy.first_byte_timeout_s,
        "max_table_age_s": policy.max_table_age_s,
        "stale_table_mode": policy.stale_table_mode,
    }

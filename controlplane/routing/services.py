"""Routing services: compile each edge's table from the database, sign, store, push, ack.

Versions come from one Postgres sequence, so they only grow — across edges, restarts and
concurrent workers — and an edge can refuse anything not newer than what it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Case, F, Field, Prefetch, Q, Value, When
from django.utils import timezone

from controlplane.core import certificates
from controlplane.core.engine_keys import engine_key
from controlplane.core.locks import advisory_lock
from controlplane.core.models import ApiKey, Tenant, Tier
from controlplane.core.services import record_audit
from controlplane.deployments.lifecycle import SERVING_STATES
from controlplane.deployments.models import Deployment, Replica, ReplicaState
from controlplane.routing import cache_salt, compiler, edge_secrets, screening, signing
from controlplane.routing.models import Edge, RoutingPolicy, RoutingTable
from controlplane.routing.push import PushResult, PushTarget, push_all
from regions.models import Region

VERSION_SEQUENCE = "routing_table_version_seq"
# Every push of new tables (the debounced task, the drift check, failover's immediate push)
# compiles and pushes under this lock, so two publishers never interleave versions.
PUBLISH_LOCK = "routing.publish"
ROUTED_STATES = tuple(SERVING_STATES | {ReplicaState.DRAINING})

log = logging.getLogger(__name__)


def next_version() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT nextval(%s)", [VERSION_SEQUENCE])
        return int(cursor.fetchone()[0])


def current_policy() -> RoutingPolicy:
    policy, _ = RoutingPolicy.objects.get_or_create(name="default")
    return policy


def policy_view(policy: RoutingPolicy) -> compiler.PolicyView:
    fail_open = frozenset(policy.fail_open_tenants.values_list("name", flat=True)) \
        if policy.pk else frozenset()
    return compiler.PolicyView(
        scorers=policy.scorers, retry_before_first_byte=policy.retry_before_first_byte,
        eject_after_failures=policy.eject_after_failures, eject_base_s=policy.eject_base_s,
        aliases=policy.aliases, resume_streams_max=policy.resume_streams_max,
        resume_deadline_s=policy.resume_deadline_s, stream_stall_s=policy.stream_stall_s,
        first_byte_timeout_s=policy.first_byte_timeout_s,
        max_table_age_s=float(policy.max_table_age_s), stale_table_mode=policy.stale_table_mode,
        fail_open_tenants=fail_open,
    )


# Revoked keys travel in every table for this long, so that an edge which missed the table
# that first left a key out still learns of it (edge/revocations.py); at most this many.
REVOKED_KEYS_DAYS = 30
REVOKED_KEYS_MAX = 10_000


def revoked_key_hashes() -> list[str]:
    since = timezone.now() - timedelta(days=REVOKED_KEYS_DAYS)
    return list(ApiKey.objects.filter(revoked_at__gte=since).order_by("-revoked_at")
                .values_list("key_hash", flat=True)[:REVOKED_KEYS_MAX])


def owners() -> tuple[dict[str, list[str]], dict[str, str]]:
    """Served name → its deployments, and replica id → its deployment: whom an exclusion
    names (routing/screening.py)."""
    models: dict[str, list[str]] = {}
    for served, name in Deployment.objects.values_list("served_model_name", "name"):
        models.setdefault(served, []).append(name)
    replicas = {replica.public_id: replica.deployment.name for replica in
                Replica.objects.filter(state__in=ROUTED_STATES).select_related("deployment")}
    return models, replicas


def replica_views() -> list[compiler.ReplicaView]:
    rows = Replica.objects.filter(state__in=ROUTED_STATES).select_related(
        "deployment__tenant", "region__cloud", "region__jurisdiction"
    )
    views = []
    for replica in rows:
        if not replica.url:
            continue
        data = replica.provider_handle.get("data", {}) if replica.provider_handle else {}
        views.append(compiler.ReplicaView(
            id=replica.public_id,
            model=replica.deployment.served_model_name,
            region=replica.region.key,
            jurisdiction=replica.region.jurisdiction.code,
            latitude=replica.region.latitude,
            longitude=replica.region.longitude,
            state=replica.state,
            url=replica.url,
            urls_by_region=data.get("urls_by_region", {}),
            tier=replica.deployment.tier,
            tenant=replica.deployment.tenant.name if replica.deployment.tenant is not None else None,
            shared_prefix_cache=replica.deployment.shared_prefix_cache,
            engine_key=engine_key(replica.public_id),
            tls_name=(certificates.replica_tls_name(replica.public_id)
                      if replica.url.startswith("https:") else ""),
            **revision_fields(replica),
        ))
    return views


def batch_pools() -> dict[str, list[str | None]]:
    """Per served model name, the tenants of its batch-tier deployments (None: shared),
    whether or not they run a replica now: batch requests go to these alone."""
    pools: dict[str, list[str | None]] = {}
    rows = Deployment.objects.filter(tier=Tier.BATCH).values_list(
        "served_model_name", "tenant__name")
    for model, tenant in rows:
        pools.setdefault(model, []).append(tenant)
    return pools


def revision_fields(replica: Replica) -> dict[str, Any]:
    """The replica's revision and its deployment's revision shares, while the deployment
    splits traffic (a rollout in progress); nothing otherwise, so tables stay as they were."""
    deployment = replica.deployment
    canary, stable = deployment.canary_revision_id, deployment.stable_revision_id
    if canary is None or stable is None:
        return {}
    def shares(weight: float) -> dict[str, float]:
        return {str(stable): 100.0 - weight, str(canary): weight}

    revision = replica.revision_id if replica.revision_id is not None else stable
    fields: dict[str, Any] = {"revision": str(revision),
                              "revision_shares": shares(float(deployment.canary_weight))}
    if deployment.canary_region_weights:  # a rollout in waves: shares by the edge's region
        fields["revision_shares_by_region"] = {
            region: shares(float(weight))
            for region, weight in deployment.canary_region_weights.items()}
    return fields


def key_views() -> list[compiler.TenantKeyView]:
    salt_key = cache_salt.salt_key()
    keys = ApiKey.objects.filter(revoked_at__isnull=True).select_related("tenant").prefetch_related(
        Prefetch("tenant", Tenant.objects.prefetch_related(
            "allowed_jurisdictions",
            Prefetch("allowed_regions", Region.objects.select_related("cloud")),
        ))
    )
    return [
        compiler.TenantKeyView(
            key_hash=key.key_hash,
            tenant=key.tenant.name,
            jurisdictions=tuple(j.code for j in key.tenant.allowed_jurisdictions.all()),
            regions=tuple(r.key for r in key.tenant.allowed_regions.all()),
            rpm=key.tenant.rpm_limit,
            tpm=key.tenant.tpm_limit,
            models=tuple(key.allowed_models or ["*"]),
            tier=key.tier,
            resume_streams=key.tenant.resume_streams,
            cache_salt=cache_salt.tenant_cache_salt(key.tenant_id, salt_key),
        )
        for key in keys
    ]


def edge_view(edge: Edge) -> compiler.EdgeView:
    return compiler.EdgeView(edge.name, edge.region.key, edge.region.latitude, edge.region.longitude)


def _content_hash(table: dict[str, Any]) -> str:
    """Hash of what an edge would act on: everything but version, time and signature."""
    stable = {k: v for k, v in table.items() if k not in ("version", "issued_at", "signature")}
    return signing.payload_hash(stable)


@transaction.atomic
def compile_tables(edges: Iterable[Edge] | None = None, force: bool = False) -> list[RoutingTable]:
    """Compile, sign and store a table for each edge whose content changed (or all, if forced).

    Returns the newest table of every edge considered, new or not.
    """
    edges = list(edges) if edges is not None else list(
        Edge.objects.filter(enabled=True).select_related("region__cloud")
    )
    if not edges:
        return []
    replicas, keys, policy = replica_views(), key_views(), policy_view(current_policy())
    pools, revoked = batch_pools(), revoked_key_hashes()
    revoked_certificates = certificates.revoked_serials()
    model_owners, replica_owners = owners()
    latest = {t.edge_id: t for t in _latest_tables([e.pk for e in edges])}
    version = next_version()
    issued_at = timezone.now().isoformat()
    kid = signing.key_id()
    result: list[RoutingTable] = []
    fresh: list[RoutingTable] = []
    for edge in edges:
        table = compiler.compile_table(
            edge_view(edge), replicas, keys, policy, version=version, issued_at=issued_at,
            key_id=kid, batch_pools=pools, revoked_keys=revoked,
            revoked_certificates=revoked_certificates,
        )
        # Parsed with the edge's own parser before it is signed: what it would refuse is
        # left out (and alerted on), never the whole table.
        table, left_out = screening.screen_table(table, model_owners=model_owners,
                                                 replica_owners=replica_owners)
        excluded = [exclusion.as_json() for exclusion in left_out]
        if excluded:
            log.error("table for %s leaves out %s", edge.name,
                      "; ".join(f"{e['subject']} ({e['field']}: {e['message']})"
                                for e in excluded))
        previous = latest.get(edge.pk)
        content = _content_hash({**table, "excluded": excluded})
        if previous is not None and not force and previous.content_hash == content:
            result.append(previous)
            continue
        signed = signing.sign(table)
        fresh.append(RoutingTable(
            edge=edge, version=version, payload=signed, payload_hash=signing.payload_hash(signed),
            content_hash=content, excluded=excluded,
        ))
    RoutingTable.objects.bulk_create(fresh, batch_size=500)
    return result + fresh


def _latest_tables(edge_ids: list[int]) -> list[RoutingTable]:
    # The payloads stay in the database until a push needs one.
    return list(
        RoutingTable.objects.filter(edge_id__in=edge_ids).order_by("edge_id", "-version")
        .distinct("edge_id").defer("payload")
    )


@dataclass(frozen=True)
class PublishReport:
    version: int | None
    results: list[PushResult]

    @property
    def acked(self) -> int:
        return sum(1 for r in self.results if r.acked)


def push_tables(tables: list[RoutingTable], timeout_s: float = 2.0) -> list[PushResult]:
    edges = {e.pk: e for e in Edge.objects.filter(pk__in=[t.edge_id for t in tables])}
    targets = [
        PushTarget(edges[t.edge_id].name, edges[t.edge_id].admin_url,
                   signing.canonical_bytes(t.payload), t.version,
                   edge_secrets.edge_secret(edges[t.edge_id].name))
        for t in tables
    ]
    results = push_all(targets, timeout_s)
    record_push_results(results)
    return results


def record_push_results(results: list[PushResult]) -> None:
    """One UPDATE for every edge answered: acks set the version and clear the error, failures
    keep their acked version and record the error. Cheap for 1,000 edges."""
    if not results:
        return
    now = timezone.now()
    acked = [r for r in results if r.acked]
    failed = [r for r in results if not r.acked]
    was_acked = Q(name__in=[r.edge for r in acked])

    def keep(field: str, *whens: When) -> Case:
        output = Edge._meta.get_field(field)
        assert isinstance(output, Field)
        return Case(*whens, default=F(field), output_field=output)

    Edge.objects.filter(name__in=[r.edge for r in results]).update(
        last_acked_version=keep(
            "last_acked_version", *(When(name=r.edge, then=Value(r.version)) for r in acked)),
        last_acked_at=keep("last_acked_at", When(was_acked, then=Value(now))),
        last_seen_at=keep("last_seen_at", When(was_acked, then=Value(now))),
        last_error=keep("last_error", When(was_acked, then=Value("")),
                        *(When(name=r.edge, then=Value(r.detail[:1000])) for r in failed)),
    )


def publish(edges: Iterable[Edge] | None = None, force: bool = False, reason: str = "") -> PublishReport:
    """Compile what changed and push each edge whatever it has not acked yet.

    Callers hold `PUBLISH_LOCK` (`publish_exclusive`); tests call this directly."""
    tables = compile_tables(edges, force=force)
    acked = acked_versions([t.edge_id for t in tables])
    behind = [t for t in tables if acked.get(t.edge_id) != t.version]
    results = push_tables(behind) if behind else []
    version = max((t.version for t in tables), default=None)
    if results:
        failed = [r.edge for r in results if not r.acked]
        record_audit(
            "system:routing", "tables.push", object_type="routing.routingtable",
            object_id=str(version),
            changes={"edges": len(results), "acked": len(results) - len(failed), "failed": failed},
            reason=reason or "routing inputs changed",
        )
    return PublishReport(version, results)


def publish_exclusive(force: bool = False, reason: str = "", wait_s: float = 0.0,
                      ) -> PublishReport | None:
    """`publish` under `PUBLISH_LOCK`; None when another publisher held it for `wait_s`.

    The one path every push of new tables takes: the debounced task (no wait: it reschedules
    itself) and failover (waits for the publisher in progress, whose tables may predate the
    failure, then compiles its own)."""
    with advisory_lock(PUBLISH_LOCK, wait_s=wait_s) as acquired:
        if not acquired:
            return None
        return publish(force=force, reason=reason)


def acked_versions(edge_ids: list[int]) -> dict[int, int | None]:
    """Each edge's last acked version, in one query."""
    return dict(Edge.objects.filter(pk__in=edge_ids).values_list("pk", "last_acked_version"))


def edges_behind() -> list[Edge]:
    """Enabled edges whose acked version is older than their newest table (drift)."""
    latest = {t.edge_id: t.version for t in _latest_tables(
        list(Edge.objects.filter(enabled=True).values_list("pk", flat=True)))}
    return [
        edge for edge in Edge.objects.filter(pk__in=latest.keys()).select_related("region__cloud")
        if edge.last_acked_version is None or edge.last_acked_version < latest[edge.pk]
    ]


def latest_table(edge: Edge) -> RoutingTable | None:
    return RoutingTable.objects.filter(edge=edge).order_by("-version").first()

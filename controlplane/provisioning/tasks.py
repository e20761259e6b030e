"""Provider jobs as Celery tasks on the `provision` queue, each safe to run twice, and
`request_replicas`, which starts them: the services do the work and never enqueue it."""

from __future__ import annotations

from functools import partial

from celery import shared_task
from django.db import transaction

from controlplane.core.locks import advisory_lock
from controlplane.core.models import Tenant
from controlplane.core.services import record_audit
from controlplane.deployments import caps
from controlplane.deployments.models import Deployment, Replica, Revision
from controlplane.deployments.models import ReplicaState as S
from controlplane.provisioning import certificate_delivery, services
from controlplane.provisioning.base import ProviderError
from regions.models import Offer, Region
from regions.services import refresh_offers

CHECK_EVERY_S = 1.0
DRAIN_POLL_S = 1.0
# A terminate the provider could not finish yet is tried again after 30 s, 60 s, ...
TERMINATE_RETRY_KINDS = frozenset({"timeout", "unavailable"})
TERMINATE_ATTEMPTS = 6
TERMINATE_RETRY_S = 30.0


@shared_task(name="provisioning.provision_replica")
def provision_replica(replica_id: int) -> str | None:
    replica = services.launch(replica_id)
    if replica is not None:
        check_replica.apply_async((replica_id,), countdown=CHECK_EVERY_S)
    return replica.state if replica is not None else None


@shared_task(name="provisioning.check_replica")
def check_replica(replica_id: int) -> str:
    state = services.check(replica_id)
    if state in (S.PROVISIONING, S.STARTING):
        check_replica.apply_async((replica_id,), countdown=CHECK_EVERY_S)
    return state


@shared_task(name="provisioning.terminate_replica")
def terminate_replica(replica_id: int, reason: str = "terminate requested",
                      attempt: int = 1) -> str:
    """Terminate; a provider that cannot say it is done yet (a launch still ending, an API
    server not answering) is asked again with a growing pause, up to TERMINATE_ATTEMPTS
    times, so that what it runs is not left running because one try came too soon."""
    try:
        return services.terminate(replica_id, reason=reason)
    except ProviderError as exc:
        if exc.kind not in TERMINATE_RETRY_KINDS or attempt >= TERMINATE_ATTEMPTS:
            raise
        terminate_replica.apply_async((replica_id, reason, attempt + 1),
                                      countdown=TERMINATE_RETRY_S * attempt)
        return f"retrying (attempt {attempt + 1} of {TERMINATE_ATTEMPTS}): {exc}"


@shared_task(name="provisioning.finish_drain")
def finish_drain(replica_id: int, reason: str, deadline_s: float) -> str:
    outcome = services.finish_drain(replica_id, reason, deadline_s)
    if outcome == "waiting":
        finish_drain.apply_async((replica_id, reason, deadline_s), countdown=DRAIN_POLL_S)
    return outcome


@shared_task(name="provisioning.reconcile_replicas")
def reconcile_replicas() -> dict[str, object]:
    with advisory_lock("provisioning.reconcile") as acquired:
        if not acquired:
            return {"skipped": "another worker is reconciling"}
        # Jobs lost with a worker are found here again from the rows (services.reconcile).
        report = services.reconcile().as_dict()
        relaunched = services.stuck_pending()
    for replica_id in relaunched:
        provision_replica.delay(replica_id)
    return {**report, "relaunched": relaunched}


@shared_task(name="provisioning.reap_cloud_clusters")
def reap_cloud_clusters() -> dict[str, list[str]]:
    with advisory_lock("provisioning.reap_cloud") as acquired:
        if not acquired:
            return {"adopted": [], "reaped": [], "skipped": ["another worker is reaping"]}
        return services.reap_cloud_clusters()


@shared_task(name="provisioning.deliver_certificates")
def deliver_certificates() -> dict[str, list[str]]:
    """Send renewed certificates to the nodes that keep copies (certificate_delivery)."""
    with advisory_lock("provisioning.deliver_certificates") as acquired:
        if not acquired:
            return {"skipped": ["another worker is delivering"]}
        return certificate_delivery.deliver_renewed()


@shared_task(name="regions.refresh_offers")
def refresh_offers_task(provider: str = "skypilot") -> dict[str, object]:
    """Fold a provider's current prices into the offers (hourly). Its name is the one it had
    in the regions app, which beat rows know it by: the catalog asks no provider itself."""
    with advisory_lock("regions.refresh_offers") as acquired:
        if not acquired:
            return {"skipped": True}
        report = refresh_offers(services.get_provider(provider))
    return {"ok": report.ok, "detail": report.detail, "stale": report.stale_offers}


@transaction.atomic
def request_replicas(
    deployment: Deployment, region: Region, count: int, *, actor: str, reason: str,
    spot: bool = False, offer: Offer | None = None, revision: Revision | None = None,
) -> list[Replica]:
    """Create `count` pending replicas; their launch is enqueued once this commits.
    `revision`: the engine settings to launch (None: the deployment's stable ones).

    Never more than the deployment's tenant may still run under its caps
    (`deployments.caps`): fewer are made, and an audit event names the cap. Callers that
    must not act on fewer (plans) check `caps.headroom` first, under the same lock."""
    count = _within_caps(deployment, count, revision, actor=actor)
    if offer is None:
        offer = (
            Offer.objects.filter(region=region, gpus_per_node__gte=deployment.tensor_parallel)
            .select_related("gpu_type").order_by("on_demand_usd_h").first()
        )
    made = []
    for _ in range(count):
        replica = Replica.objects.create(
            deployment=deployment, region=region, offer=offer,
            provider=services.provider_name_for(region), spot=spot, revision=revision,
        )
        record_audit(actor, "replica.requested", replica, reason=reason,
                     changes={"region": region.key, "offer": str(offer) if offer else None})
        transaction.on_commit(partial(provision_replica.delay, replica.pk))
        made.append(replica)
    return made


def _within_caps(deployment: Deployment, count: int, revision: Revision | None, *,
                 actor: str) -> int:
    """How many of `count` new replicas the tenant's caps allow; the tenant's row is locked
    until the transaction ends, so two additions cannot both pass the same headroom."""
    if deployment.tenant_id is None or count <= 0:
        return count
    Tenant.objects.select_for_update().filter(pk=deployment.tenant_id).first()
    engine = revision if revision is not None else deployment
    room = caps.headroom(deployment, engine.tensor_parallel, engine.pipeline_parallel)
    if room.replicas is None or count <= room.replicas:
        return count
    record_audit(actor, "replica.refused_cap", deployment,
                 reason=f"{count} replicas asked, {room.replicas} made: {room.why}",
                 changes={"asked": count, "made": room.replicas})
    return room.replicas

"""Provisioning services: launch, watch, drain, terminate and reconcile replicas.

Every provider call is recorded as an Operation row. State changes go through
deployments.lifecycle.transition, whose conditional updates make each step safe to run
twice at once: the loser of a race gets IllegalTransition and stops.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from controlplane.core import certificates
from controlplane.core.engine_keys import engine_key
from controlplane.core.services import record_audit
from controlplane.deployments.lifecycle import LIVE_STATES, IllegalTransition, transition
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.deployments.services import engine_args_of
from controlplane.deployments.shape import replica_nodes
from controlplane.provisioning import engine_tls
from controlplane.provisioning.base import Provider, ProviderError, ProviderHandle, ReplicaSpec
from controlplane.provisioning.local import LocalProvider
from controlplane.provisioning.local_regions import parse_netns
from controlplane.provisioning.models import Operation, OperationKind, OperationStatus
from controlplane.provisioning.readiness import engine_readiness
from controlplane.provisioning.skypilot import SkyPilotProvider
from controlplane.telemetry.sources import scrape_all
from regions.models import Region

log = logging.getLogger(__name__)

SYSTEM = "system:provisioning"
# How long a replica may take from launch to ready before it is failed.
READY_TIMEOUT = timedelta(seconds=int(getattr(settings, "MERIDIAN_READY_TIMEOUT_S", 1800)))
# The queue is a hint, the rows are the truth: a job lost with the worker that held it (killed
# mid-task, or holding a countdown message in memory) is found again by `reconcile` from the
# replica's state and age. A pending replica this old gets its launch enqueued again (the
# launch's conditional transition lets only one of two launches act) ...
PENDING_STUCK = timedelta(seconds=10)
# ... a launch that never recorded its provider handle (its worker died inside the provider
# call) is failed, so failover replaces it and the reaper stops what it may have started ...
LAUNCH_LOST = timedelta(seconds=20)
# ... and a drain past twice its deadline (the deadline's terminate task was lost) ends.
DRAIN_OVERDUE = timedelta(seconds=60)


# -- providers ------------------------------------------------------------------------------

_providers: dict[str, Provider] = {}


def provider_name_for(region: Region) -> str:
    return "local" if region.cloud.name == "local" else "skypilot"


def get_provider(name: str) -> Provider:
    """The provider instance for `name`: one installed with set_provider, else a fresh one.

    Fresh each call: the local provider's regions come from the database and may have been
    added since this worker started (the lab creates them after starting its worker).
    """
    if name in _providers:
        return _providers[name]
    return _build_provider(name)


def set_provider(name: str, provider: Provider | None) -> None:
    """Install (or with None, forget) a provider instance: the lab and tests use this."""
    if provider is None:
        _providers.pop(name, None)
    else:
        _providers[name] = provider


def _build_provider(name: str) -> Provider:
    if name == "local":
        return LocalProvider(**local_provider_config(),
                             tls_client=certificates.client_context if settings.ENGINE_TLS
                             else None)
    if name == "skypilot":
        return SkyPilotProvider()
    raise ProviderError("invalid", f"unknown provider {name!r}")


def local_provider_config() -> dict[str, Any]:
    regions = Region.objects.filter(cloud__name="local").select_related("cloud")
    return {
        "state_dir": settings.VAR_DIR / "lab" / "replicas",
        "regions": [
            {"code": r.key, "latitude": r.latitude, "longitude": r.longitude} for r in regions
        ],
        "netns": parse_netns(settings.MERIDIAN["LAB_NETNS"]),
    }


def handle_of(replica: Replica) -> ProviderHandle | None:
    data = replica.provider_handle or {}
    if not data.get("id"):
        return None
    return ProviderHandle(provider=data["provider"], id=data["id"], data=data.get("data", {}))


def handle_json(handle: ProviderHandle) -> dict[str, Any]:
    return {"provider": handle.provider, "id": handle.id, "data": handle.data}


def spec_for(replica: Replica) -> ReplicaSpec:
    """What the provider launches: one engine with the deployment's TP × PP on the replica's
    offer, the layout the placement solver sized and priced the offer for. ProviderError
    ('invalid') when the offer's nodes cannot hold that layout."""
    deployment = replica.deployment
    offer = replica.offer
    tp, pp = deployment.tensor_parallel, deployment.pipeline_parallel
    hf_id, args = deployment.model.hf_id, engine_args_of(deployment)
    revision = replica.revision
    if revision is not None and revision.pk != deployment.stable_revision_id:
        # A canary: the revision's own settings (the stable one's are the deployment's).
        tp, pp, hf_id = revision.tensor_parallel, revision.pipeline_parallel, revision.model.hf_id
        args = {**args, **revision.engine_args}
    gpus = offer.gpus_per_node if offer else tp
    accelerator = offer.gpu_type.skypilot_name if offer else "H100"
    # The nodes the solver sized and costs bill. Nodes that cannot hold the layout (say, a
    # plan older than a settings change) are refused here, before any provider is asked.
    nodes = replica_nodes(tp, pp, gpus)
    if nodes is None:
        raise ProviderError("invalid", (
            f"{gpus}× {accelerator} nodes cannot hold {deployment.name}'s engine "
            f"(tensor_parallel {tp} × pipeline_parallel {pp}): a TP group stays in one node "
            "and pipeline stages split evenly over the nodes"))
    return ReplicaSpec(
        replica_id=replica.public_id,
        deployment=deployment.name,
        model=hf_id,
        served_model_name=deployment.served_model_name,
        cloud=replica.region.cloud.skypilot_name or replica.region.cloud.name,
        region=replica.region.code,
        accelerator=accelerator,
        gpus_per_node=gpus,
        nodes=nodes,
        use_spot=replica.spot,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        max_model_len=int(args["max_model_len"]),
        enable_prefix_caching=bool(args["enable_prefix_caching"]),
        engine=str(args["engine"]),
    )


# -- operations -----------------------------------------------------------------------------

@dataclass
class OperationRecorder:
    operation: Operation

    def note(self, line: str) -> None:
        stamp = timezone.now().strftime("%H:%M:%S")
        self.operation.log += f"{stamp} {line}\n"
        Operation.objects.filter(pk=self.operation.pk).update(log=self.operation.log)

    def finish(self, ok: bool, error_kind: str = "") -> None:
        status = OperationStatus.SUCCEEDED if ok else OperationStatus.FAILED
        Operation.objects.filter(pk=self.operation.pk).update(
            status=status, error_kind=error_kind, finished_at=timezone.now(),
            log=self.operation.log,
        )


def start_operation(kind: str, provider: str, replica: Replica | None) -> OperationRecorder:
    op = Operation.objects.create(
        kind=kind, provider=provider, replica=replica, status=OperationStatus.RUNNING,
        started_at=timezone.now(), attempts=1,
    )
    return OperationRecorder(op)


# -- requesting and launching -----------------------------------------------------------------

def launch(replica_id: int) -> Replica | None:
    """pending → provisioning: ask the provider for the replica (non-blocking)."""
    replica = Replica.objects.select_related(
        "deployment__model", "region__cloud", "offer__gpu_type"
    ).get(pk=replica_id)
    try:
        replica = transition(replica, S.PROVISIONING, actor=SYSTEM, reason="launch requested")
    except IllegalTransition as exc:
        log.info("not launching: %s", exc)  # someone else launched it, or it was cancelled
        return None
    replica = Replica.objects.select_related(
        "deployment__model", "region__cloud", "offer__gpu_type"
    ).get(pk=replica_id)
    recorder = start_operation(OperationKind.LAUNCH, replica.provider, replica)
    try:
        provider = get_provider(replica.provider)
        spec = engine_tls.secure(spec_for(replica), provider)
        recorder.note(f"launching {spec.served_model_name} in {replica.region.key}"
                      + (" with mTLS" if spec.tls_dir else ""))
        handle = provider.launch(spec)
    except ProviderError as exc:
        recorder.note(f"provider refused: {exc}")
        recorder.finish(False, exc.kind)
        transition(replica, S.FAILED, actor=SYSTEM, reason=f"launch failed: {exc}",
                   last_error=str(exc))
        return None
    except Exception as exc:
        recorder.note("unexpected error:\n" + traceback.format_exc())
        recorder.finish(False, "other")
        transition(replica, S.FAILED, actor=SYSTEM, reason=f"launch crashed: {exc}",
                   last_error=str(exc))
        raise
    stored = handle_json(handle)
    if spec.tls_dir and provider.capabilities.delivers_certificates:
        stored["tls"] = launched_certificate(spec.replica_id)
    Replica.objects.filter(pk=replica.pk).update(provider_handle=stored)
    recorder.note(f"launched as {handle.id}")
    recorder.finish(True)
    return Replica.objects.get(pk=replica.pk)


def launched_certificate(replica_id: str) -> dict[str, Any]:
    """The certificate a launch's secrets carried to the node (certificate_delivery sends
    the renewed ones): its serial, with no delivery job to follow."""
    row = certificates.current(f"replica:{replica_id}")
    return {"serial": row.serial if row is not None else "", "job": None}


def _launch_ended(replica: Replica, state: str, message: str, error_kind: str) -> None:
    """A launch the provider accepted and later reports failed (a SkyPilot launch fails in the
    API server, after `launch` returned): the replica's launch Operation ends failed, with the
    error kind and the provider's words in its log."""
    operation = Operation.objects.filter(replica=replica, kind=OperationKind.LAUNCH).order_by(
        "-created_at", "-id").first()
    recorder = (OperationRecorder(operation) if operation is not None
                else start_operation(OperationKind.LAUNCH, replica.provider, replica))
    recorder.note(f"provider says {state}: {message}")
    recorder.finish(False, error_kind or "other")


def check(replica_id: int) -> str:
    """Advance a launching replica: provisioning → starting → ready, or failed.

    Returns the replica's state afterwards; callers re-check while it is not settled. Safe to
    run twice at once (the check chain and `reconcile`): the loser of a transition race
    returns the state the winner left.
    """
    try:
        return _check(replica_id)
    except IllegalTransition:
        return str(Replica.objects.filter(pk=replica_id).values_list("state", flat=True).first())


def _check(replica_id: int) -> str:
    replica = Replica.objects.select_related("deployment", "region__cloud").get(pk=replica_id)
    if replica.state not in (S.PROVISIONING, S.STARTING):
        return replica.state
    handle = handle_of(replica)
    if handle is None:
        return replica.state
    provider = get_provider(replica.provider)
    status = provider.poll(handle)
    if status.state in ("failed", "terminated"):
        _launch_ended(replica, status.state, status.message, status.error_kind)
        transition(replica, S.FAILED, actor=SYSTEM, reason=f"provider says {status.state}: "
                   f"{status.message}", last_error=status.message)
        return S.FAILED
    if timezone.now() - replica.created_at > READY_TIMEOUT:
        _launch_ended(replica, "failed", f"not ready after {READY_TIMEOUT}: {status.message}",
                      "timeout")
        transition(replica, S.FAILED, actor=SYSTEM, reason="not ready in time",
                   last_error=f"not ready after {READY_TIMEOUT}")
        return S.FAILED
    if status.state != "running":
        return replica.state
    url = provider.endpoint(handle) or ""
    if replica.state == S.PROVISIONING:
        replica = transition(replica, S.STARTING, actor=SYSTEM, reason="node running", url=url)
    # Each engine guards /v1/* with its own key; with mTLS every path wants the control
    # plane's client certificate.
    readiness = engine_readiness(url, replica.deployment.served_model_name,
                                 api_key=engine_key(replica.public_id),
                                 context=engine_tls.client_context())
    if not readiness.ready:
        return S.STARTING
    transition(replica, S.READY, actor=SYSTEM, reason=readiness.detail)
    return S.READY


def terminate(replica_id: int, *, actor: str = SYSTEM, reason: str = "terminate") -> str:
    replica = Replica.objects.select_related("deployment", "region__cloud").get(pk=replica_id)
    if replica.state == S.TERMINATED:
        return S.TERMINATED
    handle = handle_of(replica)
    recorder = start_operation(OperationKind.TERMINATE, replica.provider, replica)
    if handle is not None:
        try:
            get_provider(replica.provider).terminate(handle)
            recorder.note(f"terminated {handle.id}")
        except ProviderError as exc:
            recorder.note(f"provider refused: {exc}")
            recorder.finish(False, exc.kind)
            raise
    if replica.state not in (S.FAILED, S.DRAINING, S.PENDING, S.PROVISIONING, S.STARTING):
        replica = transition(replica, S.DRAINING, actor=actor, reason=reason)
    transition(replica, S.TERMINATED, actor=actor, reason=reason)
    recorder.finish(True)
    return S.TERMINATED


def drain(replica_id: int, *, actor: str, reason: str) -> Replica:
    """ready/degraded → draining: weight 0 in the next tables; terminated once nothing is in
    flight (`finish_drain`) or at the deadline, whichever comes first."""
    return transition(replica_id, S.DRAINING, actor=actor, reason=reason)


def finish_drain(replica_id: int, reason: str, deadline_s: float) -> str:
    """Terminate a draining replica once its engine has nothing running or waiting.

    Returns "terminated", "waiting" (requests still in flight: check again), or "left" (not
    draining any more, past the deadline, or its metrics unreadable: the deadline's own
    terminate task decides).
    """
    replica = Replica.objects.filter(pk=replica_id).first()
    if replica is None or replica.state != S.DRAINING or not replica.url:
        return "left"
    if (timezone.now() - replica.state_changed_at).total_seconds() >= deadline_s:
        return "left"
    scrape = scrape_all({str(replica_id): replica.url}, timeout_s=1.0,
                        context=engine_tls.client_context())[str(replica_id)]
    if scrape.snapshot is None:
        return "left"
    in_flight = scrape.snapshot.running + scrape.snapshot.waiting
    if in_flight > 0:
        return "waiting"
    try:
        terminate(replica_id, actor="system:drain", reason=f"{reason}; drained: nothing in flight")
    except (ProviderError, IllegalTransition) as exc:
        log.warning("could not finish draining r-%s: %s", replica_id, exc)
        return "left"
    return "terminated"


# -- reconciliation ---------------------------------------------------------------------------

@dataclass
class ReconcileReport:
    checked: int = 0
    failed: list[str] = field(default_factory=list)
    reaped: list[str] = field(default_factory=list)
    terminated: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "failed": self.failed, "reaped": self.reaped,
                "terminated": self.terminated}


def reconcile() -> ReconcileReport:
    """Desired vs actual: fail replicas whose process or node is gone and reap provider
    resources no replica owns. Replacing failed replicas is failover's job
    (controlplane.failover.replacements.replace_failed), placed by the solver."""
    report = ReconcileReport()
    now = timezone.now()
    live = Replica.objects.filter(state__in=LIVE_STATES - {S.PENDING}).select_related(
        "deployment", "region__cloud"
    )
    for replica in live:
        handle = handle_of(replica)
        if handle is None:
            if replica.state == S.PROVISIONING and now - replica.state_changed_at > LAUNCH_LOST:
                _fail_lost_launch(replica, report)
            continue
        report.checked += 1
        if replica.state in (S.PROVISIONING, S.STARTING):
            # The check chain may have died with its worker; checking again is harmless.
            if check(replica.pk) == S.FAILED:
                report.failed.append(replica.public_id)
            continue
        if replica.state == S.DRAINING and now - replica.state_changed_at > DRAIN_OVERDUE:
            try:
                terminate(replica.pk, actor="system:reconcile",
                          reason="drain overdue: its deadline passed long ago")
                report.terminated.append(replica.public_id)
            except (ProviderError, IllegalTransition) as exc:
                log.warning("could not end the drain of %s: %s", replica.public_id, exc)
            continue
        status = get_provider(replica.provider).poll(handle)
        if status.state in ("failed", "terminated"):
            try:
                transition(replica, S.FAILED, actor="system:reconcile",
                           reason=f"provider reports {status.state}: {status.message}",
                           last_error=status.message)
                report.failed.append(replica.public_id)
            except IllegalTransition:
                continue
    report.reaped.extend(reap_unowned())
    return report


def _fail_lost_launch(replica: Replica, report: ReconcileReport) -> None:
    try:
        transition(replica, S.FAILED, actor="system:reconcile",
                   reason=f"launch lost: no provider handle after {LAUNCH_LOST.seconds} s",
                   last_error="launch lost (its worker stopped during the provider call)")
        report.failed.append(replica.public_id)
    except IllegalTransition:
        pass


def stuck_pending() -> list[int]:
    """Pending replicas whose launch should have started by now: the message was lost with
    its worker. The caller enqueues their launch again."""
    return list(Replica.objects.filter(state=S.PENDING,
                                       created_at__lt=timezone.now() - PENDING_STUCK)
                .order_by("pk").values_list("pk", flat=True))


def _wanted_replica_ids() -> set[str]:
    return {f"r-{pk}" for pk in
            Replica.objects.filter(state__in=LIVE_STATES).values_list("pk", flat=True)}


def reap_unowned() -> list[str]:
    """Release local processes that no live replica row owns (e.g. after a crash); runs
    with every reconcile, since looking costs nothing."""
    reaped: list[str] = []
    for name in ("local",):
        provider = get_provider(name)
        if provider.capabilities.adopts_after_restart:
            _, gone = provider.adopt_or_reap(_wanted_replica_ids())
            reaped.extend(gone)
    return reaped


def reap_cloud_clusters() -> dict[str, list[str]]:
    """`sky down` every Meridian cluster (`mrd-r-N`) that no live replica owns: a launch the
    control plane lost track of (a crash between the launch and saving its handle, a row
    deleted by hand). Each look costs SkyPilot API-server requests, so this runs on its own
    slow schedule, and only once this control plane has ever launched through SkyPilot."""
    if not Replica.objects.filter(provider="skypilot").exists():
        return {"adopted": [], "reaped": []}
    recorder = start_operation(OperationKind.RECONCILE, "skypilot", None)
    try:
        adopted, reaped = get_provider("skypilot").adopt_or_reap(_wanted_replica_ids())
    except ProviderError as exc:
        recorder.note(f"provider refused: {exc}")
        recorder.finish(False, exc.kind)
        raise
    recorder.note(f"kept {len(adopted)} cluster(s); took down {', '.join(reaped) or 'none'}")
    recorder.finish(True)
    if reaped:
        record_audit("system:reconcile", "provisioning.reap", object_type="provisioning.cluster",
                     object_id=",".join(reaped), reason="clusters no live replica owns",
                     changes={"reaped": reaped})
    return {"adopted": adopted, "reaped": reaped}


def terminate_failed(replica: Replica) -> None:
    """Release a failed replica's resources and mark it terminated."""
    try:
        terminate(replica.pk, actor="system:reconcile", reason="clean up failed replica")
    except (ProviderError, IllegalTransition) as exc:
        log.warning("could not clean up %s: %s", replica.public_id, exc)

"""One row of every tenant-owned model, for a given tenant (None: shared or platform-wide).

`BUILDERS` has an entry for each model `controlplane.core.tenancy.tenant_owned_models()`
finds; a test fails when a model is added without one, so the tenancy tests reach it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from django.db import models

from controlplane.core.models import Tenant

if TYPE_CHECKING:  # the builders import their models when called, once Django is set up
    from controlplane.alerts.models import Alert
    from controlplane.batches.models import Batch, BatchFile
    from controlplane.deployments.models import Deployment, Replica, Revision
    from controlplane.rollouts.models import Rollout
    from controlplane.telemetry.models import GpuNode

_serial = itertools.count(1)
NOW = datetime(2026, 11, 2, 12, tzinfo=UTC)

Builder = Callable[[dict[str, Any], Tenant | None], models.Model | None]


def _n() -> int:
    return next(_serial)


def deployment(fx: dict[str, Any], tenant: Tenant | None) -> Deployment:
    from controlplane.deployments.models import Deployment

    row = Deployment.objects.create(name=f"dep-{_n()}", served_model_name="llama-3.1-8b",
                                    model=fx["llama8b"], tenant=tenant)
    row.allowed_jurisdictions.set([fx["eu"]])
    return row


def replica(fx: dict[str, Any], tenant: Tenant | None) -> Replica:
    from controlplane.deployments.models import Replica

    return Replica.objects.create(deployment=deployment(fx, tenant), region=fx["fra"])


def revision(fx: dict[str, Any], tenant: Tenant | None) -> Revision:
    from controlplane.deployments.models import Deployment
    from controlplane.deployments.services import stable_revision

    row = deployment(fx, tenant)
    assert isinstance(row, Deployment)
    return stable_revision(row)


def rollout(fx: dict[str, Any], tenant: Tenant | None) -> Rollout:
    from controlplane.deployments.models import Revision
    from controlplane.rollouts.models import Rollout

    stable = revision(fx, tenant)
    assert isinstance(stable, Revision)
    return Rollout.objects.create(deployment=stable.deployment, from_revision=stable,
                                  to_revision=stable, steps=[100], bake_s=1)


def rollout_step(fx: dict[str, Any], tenant: Tenant | None) -> models.Model:
    from controlplane.rollouts.models import RolloutStep

    return RolloutStep.objects.create(rollout=rollout(fx, tenant), step=0, weight=100)


def gpu_node(fx: dict[str, Any], tenant: Tenant | None) -> GpuNode:
    from controlplane.telemetry.models import GpuNode

    return GpuNode.objects.create(name=f"node-{_n()}", replica=replica(fx, tenant))


def alert(fx: dict[str, Any], tenant: Tenant | None) -> Alert:
    from controlplane.alerts.models import Alert

    return Alert.objects.create(rule="ttft_slo", subject=f"subject-{_n()}", tenant=tenant,
                                severity="warning", message="slow", firing_since=NOW,
                                opened_at=NOW, last_evaluated_at=NOW)


def _tenant(fx: dict[str, Any], tenant: Tenant | None) -> models.Model | None:
    return tenant


def _membership(fx: dict[str, Any], tenant: Tenant | None) -> models.Model:
    from controlplane.core.models import Role
    from controlplane.core.services import ensure_user

    return ensure_user(f"user-{_n()}", Role.VIEWER, tenant).membership  # type: ignore[attr-defined]


def _api_key(fx: dict[str, Any], tenant: Tenant | None) -> models.Model | None:
    from controlplane.core.services import issue_api_key

    return None if tenant is None else issue_api_key(tenant, f"key-{_n()}", "interactive")[0]


def _audit(fx: dict[str, Any], tenant: Tenant | None) -> models.Model:
    from controlplane.core.models import AuditLog

    return AuditLog.objects.create(actor="tester", action="create", object_type="t.t",
                                   object_id=str(_n()), tenant=tenant)


def _plan_change(fx: dict[str, Any], tenant: Tenant | None) -> models.Model:
    from controlplane.placement.models import Plan, PlanChange

    plan = Plan.objects.create(proposed_by="tester")
    return PlanChange.objects.create(plan=plan, deployment=deployment(fx, tenant), action="add",
                                     region=fx["fra"], count=1, reason="test")


def _operation(fx: dict[str, Any], tenant: Tenant | None) -> models.Model:
    from controlplane.provisioning.models import Operation

    return Operation.objects.create(kind="launch", provider="local", replica=replica(fx, tenant))


def _replica_sample(fx: dict[str, Any], tenant: Tenant | None) -> models.Model:
    from controlplane.telemetry.models import ReplicaSample

    return ReplicaSample.objects.create(replica=replica(fx, tenant), at=NOW)


def _gpu_reading(fx: dict[str, Any], tenant: Tenant | None) -> models.Model:
    from controlplane.telemetry.models import GpuReading

    return GpuReading.objects.create(node=gpu_node(fx, tenant), at=NOW, index=0,
                                     uuid=f"GPU-{_n()}", name="H100")


def _scaling_decision(fx: dict[str, Any], tenant: Tenant | None) -> models.Model:
    from controlplane.scaling.models import ScalingDecision

    return ScalingDecision.objects.create(deployment=deployment(fx, tenant), at=NOW, direction="up",
                                   replicas_before=1, replicas_after=2, reason="test")


def _usage(fx: dict[str, Any], tenant: Tenant | None) -> models.Model:
    from controlplane.costs.models import TokenUsage

    return TokenUsage.objects.create(hour=NOW, model="m", region=f"aws:r-{_n()}",
                                     tenant=tenant.name if tenant else "")


def _rollup(fx: dict[str, Any], tenant: Tenant | None) -> models.Model:
    from controlplane.costs.models import CostRollup

    return CostRollup.objects.create(hour=NOW, model="m", region=f"aws:r-{_n()}",
                                     tenant=tenant.name if tenant else "", computed_at=NOW)


def _delivery(fx: dict[str, Any], tenant: Tenant | None) -> models.Model:
    from controlplane.alerts.models import AlertDelivery

    return AlertDelivery.objects.create(alert=alert(fx, tenant), event="opened",
                                        url="https://hooks.example/x", payload={}, created_at=NOW)


def _batch_file(fx: dict[str, Any], tenant: Tenant | None) -> BatchFile | None:
    from controlplane.batches.models import BatchFile

    return None if tenant is None else BatchFile.objects.create(
        tenant=tenant, purpose="batch", filename=f"in-{_n()}.jsonl", bytes=2, line_count=1,
        content=b"{}")


def _batch(fx: dict[str, Any], tenant: Tenant | None) -> Batch | None:
    from controlplane.batches.models import Batch

    source = _batch_file(fx, tenant)
    return None if tenant is None or source is None else Batch.objects.create(
        tenant=tenant, input_file=source, endpoint="/v1/chat/completions", model="m",
        expires_at=NOW)


def _batch_line(fx: dict[str, Any], tenant: Tenant | None) -> models.Model | None:
    from controlplane.batches.models import BatchLine

    batch = _batch(fx, tenant)
    return None if batch is None else BatchLine.objects.create(
        batch=batch, line_number=1, custom_id=f"c-{_n()}", body={})


BUILDERS: dict[str, Builder] = {
    "core.Tenant": _tenant,
    "core.Membership": _membership,
    "core.ApiKey": _api_key,
    "core.AuditLog": _audit,
    "deployments.Deployment": deployment,
    "deployments.Replica": replica,
    "deployments.Revision": revision,
    "rollouts.Rollout": rollout,
    "rollouts.RolloutStep": rollout_step,
    "placement.PlanChange": _plan_change,
    "provisioning.Operation": _operation,
    "telemetry.ReplicaSample": _replica_sample,
    "telemetry.GpuNode": gpu_node,
    "telemetry.GpuReading": _gpu_reading,
    "scaling.ScalingDecision": _scaling_decision,
    "costs.TokenUsage": _usage,
    "costs.CostRollup": _rollup,
    "alerts.Alert": alert,
    "alerts.AlertDelivery": _delivery,
    "batches.BatchFile": _batch_file,
    "batches.Batch": _batch,
    "batches.BatchLine": _batch_line,
}

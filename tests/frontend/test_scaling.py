"""The shared scaling service (controlplane/scaling/services.py) the dashboard calls."""

from __future__ import annotations

import pytest

from controlplane.core.models import AuditLog
from controlplane.deployments.lifecycle import IllegalTransition
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.scaling.services import (
    ScaleRefused,
    drain_replica,
    scale_in_region,
)

pytestmark = pytest.mark.django_db


def test_a_region_outside_the_jurisdictions_is_refused_naming_it(fleet, catalog):  # type: ignore[no-untyped-def]
    with pytest.raises(ScaleRefused) as refused:
        scale_in_region(fleet.acme, catalog["iad"], 1, actor="op")
    assert refused.value.field == "region"
    assert "aws:us-east-1 is in US" in refused.value.message


def test_falling_below_min_replicas_is_refused(fleet, catalog):  # type: ignore[no-untyped-def]
    fleet.acme.min_replicas = 1000
    fleet.acme.save()
    with pytest.raises(ScaleRefused, match=r"below min_replicas \(1000\)"):
        scale_in_region(fleet.acme, catalog["ams"], 0, actor="op")


def test_a_preview_changes_nothing(fleet, catalog):  # type: ignore[no-untyped-def]
    before = (Replica.objects.count(), AuditLog.objects.count())
    result = scale_in_region(fleet.acme, catalog["fra"], 0, actor="op", preview=True)
    assert result.after == 0 and result.draining and not result.added
    assert (Replica.objects.count(), AuditLog.objects.count()) == before


def test_scaling_up_requests_pending_replicas_with_an_audit_event(fleet, catalog):  # type: ignore[no-untyped-def]
    result = scale_in_region(fleet.acme, catalog["ams"], 5, actor="op", reason="launch day")
    assert len(result.added) == result.to_add == 5 - result.before
    added = Replica.objects.filter(pk__in=[int(i.removeprefix("r-")) for i in result.added])
    assert {r.state for r in added} == {S.PENDING}
    assert AuditLog.objects.filter(action="replica.requested", actor="op",
                                   reason="launch day").count() == len(result.added)


def test_only_serving_replicas_drain(fleet):  # type: ignore[no-untyped-def]
    pending = next(r for r in fleet.replicas if r.state == S.PENDING)
    with pytest.raises(IllegalTransition):
        drain_replica(pending, actor="op")
    ready = next(r for r in fleet.replicas if r.state == S.READY)
    assert drain_replica(ready, actor="op").state == S.DRAINING


def test_retiring_a_replica_that_does_not_serve_records_who_asked(fleet, catalog):  # type: ignore[no-untyped-def]
    starting = next(r for r in fleet.replicas
                    if r.deployment_id == fleet.acme.pk and r.state == S.STARTING)
    scale_in_region(fleet.acme, starting.region, 0, actor="op", reason="too many")
    event = AuditLog.objects.get(action="replica.terminate_requested", object_id=str(starting.pk))
    assert (event.actor, event.reason, event.changes["state"]) == ("op", "too many", "starting")

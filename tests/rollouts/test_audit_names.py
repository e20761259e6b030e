"""Audit entries name objects the way the pages do: a rollout "of chat-eu", a revision of
chat-eu, never the deployment's numeric id ("rollout 3 of 1")."""

from __future__ import annotations

import pytest

from controlplane.core.models import AuditLog, Role
from controlplane.deployments.models import Revision
from controlplane.scaling.models import ScalingDecision

pytestmark = pytest.mark.django_db


def test_a_rolled_back_rollouts_audit_entries_name_its_deployment(deployment, make_client):  # type: ignore[no-untyped-def]
    operator = make_client(Role.OPERATOR)
    created = operator.post("/api/v1/rollouts/", {"deployment": deployment.name, "bake_s": 60},
                            format="json")
    assert created.status_code == 201, created.content
    rid = created.json()["id"]
    assert operator.post(f"/api/v1/rollouts/{rid}/rollback/", {"reason": "slow"},
                         format="json").status_code == 200
    entries = AuditLog.objects.filter(object_type="rollouts.rollout", object_id=str(rid))
    assert {e.action for e in entries} >= {"rollout.started", "rollout.rolled_back"}
    for entry in entries:
        assert entry.object_repr.startswith(f"rollout {rid} of chat-eu"), entry.object_repr
        assert f" of {deployment.pk} " not in entry.object_repr


def test_revisions_and_scaling_decisions_name_their_deployment(deployment):  # type: ignore[no-untyped-def]
    revision = Revision(deployment=deployment, number=7, model=deployment.model)
    assert str(revision) == "chat-eu revision 7"
    decision = ScalingDecision(deployment=deployment, direction="up", replicas_before=1,
                               replicas_after=2)
    assert str(decision) == "chat-eu up 1→2"

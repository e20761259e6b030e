"""The replica state machine: legal paths, refused moves, races and the audit trail."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from controlplane.core.models import AuditLog
from controlplane.deployments.lifecycle import TRANSITIONS, IllegalTransition, transition
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from tests.api.test_endpoints_crud import make_deployment


@pytest.fixture
def replica(catalog, tenants):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat")
    return Replica.objects.create(deployment=deployment, region=catalog["fra"])


@pytest.mark.django_db
def test_happy_path_records_each_step(replica):  # type: ignore[no-untyped-def]
    for state in (S.PROVISIONING, S.STARTING, S.READY, S.DRAINING, S.TERMINATED):
        replica = transition(replica, state, actor="system:test", reason=f"to {state}")
    assert replica.ready_at is not None and replica.terminated_at is not None
    actions = list(AuditLog.objects.order_by("id").values_list("action", flat=True))
    assert actions == ["replica.provisioning", "replica.starting", "replica.ready",
                       "replica.draining", "replica.terminated"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("path", "wanted"),
    [
        ([], S.READY),
        ([S.PROVISIONING], S.DRAINING),
        ([S.TERMINATED], S.PROVISIONING),
        ([S.FAILED], S.READY),
        ([S.PROVISIONING, S.STARTING, S.READY], S.PENDING),
    ],
)
def test_illegal_moves_are_refused_and_leave_state(replica, path, wanted):  # type: ignore[no-untyped-def]
    for state in path:
        transition(replica, state, actor="t", reason="setup")
    before = Replica.objects.get(pk=replica.pk).state
    with pytest.raises(IllegalTransition, match=f"cannot go from {before} to {wanted}"):
        transition(replica, wanted, actor="t", reason="bad")
    assert Replica.objects.get(pk=replica.pk).state == before


def test_every_live_state_can_fail():
    for state, targets in TRANSITIONS.items():
        if state not in (S.TERMINATED, S.FAILED):
            assert S.FAILED in targets, state


@pytest.mark.django_db(transaction=True)
def test_two_workers_racing_move_a_replica_once(catalog, tenants):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "race")
    replica = Replica.objects.create(deployment=deployment, region=catalog["fra"])
    barrier = threading.Barrier(4)
    outcomes: list[str] = []

    def worker() -> None:
        barrier.wait()
        try:
            transition(replica.pk, S.PROVISIONING, actor="w", reason="race")
            outcomes.append("moved")
        except IllegalTransition:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["moved", "refused", "refused", "refused"]
    assert AuditLog.objects.filter(action="replica.provisioning").count() == 1

"""During a rollout a failed canary replica is replaced by one of the canary revision, so
the canary keeps the capacity its step needs; a failed stable replica's replacement stays
the stable revision's."""

from __future__ import annotations

import pytest

from controlplane.deployments.models import Deployment, Replica, Revision
from controlplane.deployments.models import ReplicaState as S
from controlplane.deployments.services import stable_revision
from controlplane.failover import services

from .conftest import dead_url

pytestmark = pytest.mark.django_db


@pytest.fixture
def canary(catalog, deployment) -> Revision:  # type: ignore[no-untyped-def]
    stable_revision(deployment)
    revision = Revision.objects.create(deployment=deployment, number=2,
                                       model=catalog["llama8b"], vllm_version="0.11.1")
    Deployment.objects.filter(pk=deployment.pk).update(canary_revision=revision,
                                                       canary_weight=25)
    return revision


def test_a_failed_canary_replica_is_replaced_by_the_canary_revision(  # type: ignore[no-untyped-def]
        catalog, deployment, canary, ready_replica, engines, sent_tasks):
    ready_replica(deployment, catalog["fra"], engines().url)
    ready_replica(deployment, catalog["fra"], engines().url)
    lost = ready_replica(deployment, catalog["fra"], dead_url())
    Replica.objects.filter(pk=lost.pk).update(revision=canary)
    services.watch()
    assert Replica.objects.get(pk=lost.pk).state in (S.FAILED, S.TERMINATED)
    (new,) = Replica.objects.filter(state=S.PENDING)
    assert new.revision_id == canary.pk


def test_a_failed_stable_replica_during_a_rollout_stays_stable(  # type: ignore[no-untyped-def]
        catalog, deployment, canary, ready_replica, engines, sent_tasks):
    serving = ready_replica(deployment, catalog["fra"], engines().url)
    Replica.objects.filter(pk=serving.pk).update(revision=canary)
    ready_replica(deployment, catalog["fra"], engines().url)
    ready_replica(deployment, catalog["fra"], dead_url())
    services.watch()
    (new,) = Replica.objects.filter(state=S.PENDING)
    assert new.revision_id is None

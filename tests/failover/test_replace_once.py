"""A failover pass that dies between committing a replacement and releasing the failed
replica (a killed worker) is rerun without replacing the same loss twice: the rerun only
releases what was already answered."""

from __future__ import annotations

import pytest

from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover import replacements, services
from controlplane.failover.models import Incident

from .conftest import dead_url

pytestmark = pytest.mark.django_db


class WatchDied(BaseException):
    """The worker running the pass is killed: nothing after this point runs."""


def test_a_pass_killed_before_releasing_the_failed_replica_does_not_replace_it_twice(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks, monkeypatch):
    ready_replica(deployment, catalog["fra"], engines().url)
    gone = ready_replica(deployment, catalog["fra"], dead_url())

    def killed(replica: Replica) -> None:
        raise WatchDied

    monkeypatch.setattr(replacements, "terminate_failed", killed)
    with pytest.raises(WatchDied):
        services.watch()
    # The crash point: the replacement is committed, the failed replica still failed.
    (replacement,) = Replica.objects.filter(state=S.PENDING)
    gone.refresh_from_db()
    assert gone.state == S.FAILED
    monkeypatch.undo()

    for _ in range(2):
        report = services.watch()
        assert report.replacements == []
    assert list(Replica.objects.filter(state=S.PENDING)) == [replacement]
    assert Replica.objects.exclude(pk__in=[gone.pk]).count() == 2  # the healthy one and it
    gone.refresh_from_db()
    assert gone.state == S.TERMINATED
    assert Incident.objects.get().replacements == [replacement.public_id]


def test_a_loss_with_no_room_anywhere_is_retried_and_not_marked_answered(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks, monkeypatch):
    ready_replica(deployment, catalog["fra"], engines().url)
    gone = ready_replica(deployment, catalog["fra"], dead_url())
    monkeypatch.setattr(replacements, "_place_replacements", lambda *args: [])
    services.watch()
    gone.refresh_from_db()
    assert gone.state == S.FAILED and gone.replacement_requested_at is None
    monkeypatch.undo()
    services.watch()
    (replacement,) = Replica.objects.filter(state=S.PENDING)
    gone.refresh_from_db()
    assert gone.state == S.TERMINATED
    assert Incident.objects.get().replacements == [replacement.public_id]

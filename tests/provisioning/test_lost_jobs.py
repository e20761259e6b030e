"""Jobs lost with a worker (killed mid-task, or holding a countdown message in memory) are
found again from the rows by the reconcile loop, and running a job twice acts once."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.core.models import AuditLog
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.provisioning import services, tasks
from controlplane.provisioning.base import ProviderError, ProviderHandle, ProviderStatus
from controlplane.provisioning.models import Operation, OperationKind

pytestmark = pytest.mark.django_db


class FakeProvider:
    """Counts launches and terminations; every replica runs and answers at one URL."""

    def __init__(self) -> None:
        self.launched: list[str] = []
        self.terminated: list[str] = []

    def launch(self, spec: Any) -> ProviderHandle:
        self.launched.append(spec.replica_id if hasattr(spec, "replica_id") else str(spec))
        return ProviderHandle("local", f"h-{len(self.launched)}")

    def poll(self, handle: ProviderHandle) -> ProviderStatus:
        return ProviderStatus("running")

    def endpoint(self, handle: ProviderHandle, from_region: Any = None) -> str:
        return "http://127.0.0.1:1"

    def terminate(self, handle: ProviderHandle) -> None:
        self.terminated.append(handle.id)

    def adopt_or_reap(self, wanted: set[str]) -> list[str]:
        return []


@pytest.fixture
def provider(monkeypatch):  # type: ignore[no-untyped-def]
    fake = FakeProvider()
    services.set_provider("local", fake)  # type: ignore[arg-type]
    monkeypatch.setattr(services, "reap_unowned", lambda: [])
    yield fake
    services.set_provider("local", None)


@pytest.fixture
def deployment(catalog):  # type: ignore[no-untyped-def]
    return Deployment.objects.create(name="d", served_model_name="m", model=catalog["llama8b"])


def replica(deployment: Deployment, region: Any, state: str, age_s: float = 0.0,
            handle: bool = False) -> Replica:
    then = timezone.now() - timedelta(seconds=age_s)
    row = Replica.objects.create(
        deployment=deployment, region=region, state=state, provider="local",
        provider_handle={"provider": "local", "id": "h-x", "data": {}} if handle else {})
    Replica.objects.filter(pk=row.pk).update(created_at=then, state_changed_at=then)
    row.refresh_from_db()
    return row


def test_a_launch_run_twice_launches_once(provider, deployment, catalog):  # type: ignore[no-untyped-def]
    row = replica(deployment, catalog["fra"], S.PENDING)
    assert services.launch(row.pk) is not None
    assert services.launch(row.pk) is None  # the redelivered message finds it provisioning
    assert len(provider.launched) == 1
    assert Operation.objects.filter(replica=row, kind=OperationKind.LAUNCH).count() == 1


def test_a_pending_replica_whose_launch_was_lost_is_launched_again(  # type: ignore[no-untyped-def]
        provider, deployment, catalog, sent_tasks):
    stuck = replica(deployment, catalog["fra"], S.PENDING, age_s=services.PENDING_STUCK.seconds + 5)
    fresh = replica(deployment, catalog["fra"], S.PENDING)
    report = tasks.reconcile_replicas()
    assert report["relaunched"] == [stuck.pk]
    assert ("provisioning.provision_replica", (stuck.pk,), {}) in sent_tasks
    assert not any(args == (fresh.pk,) for _, args, _ in sent_tasks)


def test_a_launch_that_died_inside_the_provider_call_is_failed(  # type: ignore[no-untyped-def]
        provider, deployment, catalog):
    lost = replica(deployment, catalog["fra"], S.PROVISIONING,
                   age_s=services.LAUNCH_LOST.seconds + 5)
    young = replica(deployment, catalog["fra"], S.PROVISIONING)
    report = services.reconcile()
    assert report.failed == [lost.public_id]
    lost.refresh_from_db()
    young.refresh_from_db()
    assert lost.state == S.FAILED and "launch lost" in lost.last_error
    assert young.state == S.PROVISIONING


def test_a_starting_replica_whose_check_chain_was_lost_becomes_ready(  # type: ignore[no-untyped-def]
        provider, deployment, catalog, monkeypatch):
    from controlplane.provisioning.readiness import Readiness

    monkeypatch.setattr(services, "engine_readiness",
                        lambda *a, **k: Readiness(True, "ready"))
    row = replica(deployment, catalog["fra"], S.STARTING, age_s=3, handle=True)
    services.reconcile()
    row.refresh_from_db()
    assert row.state == S.READY


def test_check_that_loses_a_race_returns_the_winners_state(  # type: ignore[no-untyped-def]
        provider, deployment, catalog, monkeypatch):
    from controlplane.provisioning.readiness import Readiness

    row = replica(deployment, catalog["fra"], S.STARTING, handle=True)

    def readiness(*args: Any, **kwargs: Any) -> Readiness:
        # The other checker moves it to ready while this one asks the engine.
        services.transition(row.pk, S.READY, actor="other", reason="ready")
        return Readiness(True, "ready")

    monkeypatch.setattr(services, "engine_readiness", readiness)
    assert services.check(row.pk) == S.READY
    assert AuditLog.objects.filter(action="replica.ready", object_id=str(row.pk)).count() == 1


def test_a_drain_whose_deadline_task_was_lost_ends(provider, deployment, catalog):  # type: ignore[no-untyped-def]
    overdue = replica(deployment, catalog["fra"], S.DRAINING, handle=True,
                      age_s=services.DRAIN_OVERDUE.seconds + 5)
    draining = replica(deployment, catalog["fra"], S.DRAINING, handle=True, age_s=5)
    report = services.reconcile()
    assert report.terminated == [overdue.public_id]
    overdue.refresh_from_db()
    draining.refresh_from_db()
    assert overdue.state == S.TERMINATED and draining.state == S.DRAINING


class NotDoneYet(FakeProvider):
    """A provider whose terminate cannot finish yet (a launch still ending on its server),
    `failures` times, with an error of `kind`."""

    def __init__(self, failures: int, kind: str = "timeout") -> None:
        super().__init__()
        self.failures = failures
        self.kind = kind

    def terminate(self, handle: ProviderHandle) -> None:
        if self.failures:
            self.failures -= 1
            raise ProviderError(self.kind, "launch request r1 is still running")
        super().terminate(handle)


def test_a_terminate_the_provider_cannot_finish_yet_is_tried_again(  # type: ignore[no-untyped-def]
        deployment, catalog, sent_tasks):
    row = replica(deployment, catalog["fra"], S.PROVISIONING, handle=True)
    slow = NotDoneYet(failures=1)
    services.set_provider("local", slow)  # type: ignore[arg-type]
    try:
        outcome = tasks.terminate_replica(row.pk, "scale in")
        assert outcome.startswith("retrying (attempt 2 of 6): timeout: launch request r1")
        assert sent_tasks == [("provisioning.terminate_replica", (row.pk, "scale in", 2),
                               {"countdown": tasks.TERMINATE_RETRY_S})]
        row.refresh_from_db()
        assert row.state == S.PROVISIONING and slow.terminated == []
        assert tasks.terminate_replica(row.pk, "scale in", 2) == S.TERMINATED  # the retry
        assert slow.terminated == ["h-x"]
    finally:
        services.set_provider("local", None)


@pytest.mark.parametrize("kind,attempt", [("credentials", 1), ("timeout", 6)])
def test_a_terminate_that_cannot_succeed_by_waiting_fails_at_once(  # type: ignore[no-untyped-def]
        deployment, catalog, sent_tasks, kind, attempt):
    row = replica(deployment, catalog["fra"], S.PROVISIONING, handle=True)
    services.set_provider("local", NotDoneYet(failures=1, kind=kind))  # type: ignore[arg-type]
    try:
        with pytest.raises(ProviderError) as caught:
            tasks.terminate_replica(row.pk, "scale in", attempt)
        assert caught.value.kind == kind and sent_tasks == []
    finally:
        services.set_provider("local", None)

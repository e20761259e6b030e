"""The lab says "Meridian lab is up." only once every engine it started is ready (moved to
ready by the provision worker's readiness check); a wait that runs out names, by public id
and region, the replicas still starting instead."""

from __future__ import annotations

from controlplane.deployments.lifecycle import transition
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.lab.fleet import ensure_fleet
from controlplane.lab.readiness import UP, headline, wait_for_engines


def become_ready(replica: Replica) -> None:
    """What the provision worker's launch and check do once the engine answers /health."""
    for state in (S.PROVISIONING, S.STARTING, S.READY):
        transition(replica.pk, state, actor="system", reason="engine answers /health")


def test_up_is_said_only_once_every_engine_is_ready(lab_database) -> None:  # type: ignore[no-untyped-def]
    ids = [r.pk for r in ensure_fleet([], None, actor="lab").requested]
    assert len(ids) == 3
    said: list[str] = []

    def say(line: str) -> None:
        """Each time the lab says what it waits for, one more engine becomes ready."""
        said.append(line)
        become_ready(Replica.objects.filter(pk__in=ids).exclude(state=S.READY).earliest("pk"))

    report = wait_for_engines(ids, 60, say, every_s=0)

    states = set(Replica.objects.filter(pk__in=ids).values_list("state", flat=True))
    assert states == {S.READY}  # it returned only once all three were ready
    assert said[0].startswith("  waiting for 3 engines: r-")
    assert "(local:eu-frankfurt)" in said[0] and "(local:ap-tokyo)" in said[0]
    assert [line.split(":")[0] for line in said] == [
        "  waiting for 3 engines", "  waiting for 2 engines", "  waiting for 1 engine"]
    assert headline(report, 1.0) == UP


def test_a_wait_that_runs_out_names_the_engines_still_starting(lab_database) -> None:  # type: ignore[no-untyped-def]
    replicas = sorted(ensure_fleet([], None, actor="lab").requested, key=lambda r: r.pk)
    for replica in replicas[:2]:
        become_ready(replica)
    slow = replicas[2]
    said: list[str] = []

    report = wait_for_engines([r.pk for r in replicas], 0.2, said.append, every_s=0.05)

    line = headline(report, 0.2)
    assert UP not in line and "is up" not in line
    assert "2 of 3 engines are ready" in line
    assert f"Still starting after 0 s: {slow.public_id} ({slow.region.key})" in line
    assert said == [f"  waiting for 1 engine: {slow.public_id} ({slow.region.key})"]


def test_an_engine_that_fails_is_named_not_waited_for(lab_database) -> None:  # type: ignore[no-untyped-def]
    replicas = sorted(ensure_fleet([], None, actor="lab").requested, key=lambda r: r.pk)
    for replica in replicas[:2]:
        become_ready(replica)
    transition(replicas[2].pk, S.FAILED, actor="system", reason="launch failed")

    report = wait_for_engines([r.pk for r in replicas], 60, lambda line: None, every_s=0)

    assert f"{replicas[2].public_id} ({replicas[2].region.key}): failed" in headline(report, 1)
    assert not report.all_ready

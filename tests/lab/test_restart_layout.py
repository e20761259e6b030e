"""A restart of the lab brings back the layout that was running: each deployment's replicas
in each local region, as they were when the lab stopped (or was killed), not one per region."""

from __future__ import annotations

from controlplane.deployments.lifecycle import LIVE_STATES
from controlplane.deployments.models import Replica
from controlplane.lab.fleet import DEMO_DEPLOYMENT, ensure_fleet, stop_local_replicas
from controlplane.provisioning.services import terminate
from controlplane.provisioning.tasks import request_replicas
from regions.models import Region


def live_layout() -> dict[str, dict[str, int]]:
    layout: dict[str, dict[str, int]] = {}
    for replica in Replica.objects.filter(state__in=LIVE_STATES).select_related(
            "deployment", "region__cloud"):
        regions = layout.setdefault(replica.deployment.name, {})
        regions[replica.region.key] = regions.get(replica.region.key, 0) + 1
    return layout


def reshape_to_two_in_frankfurt_none_in_virginia() -> None:
    """What an operator did while the lab ran: a second replica in Frankfurt, Virginia's
    terminated."""
    first = Replica.objects.get(region__code="us-virginia", state__in=LIVE_STATES)
    terminate(first.pk, actor="admin", reason="not needed in Virginia")
    frankfurt = Region.objects.get(cloud__name="local", code="eu-frankfurt")
    request_replicas(first.deployment, frankfurt, 1, actor="admin", reason="more in Europe")


KEPT = {DEMO_DEPLOYMENT: {"local:eu-frankfurt": 2, "local:ap-tokyo": 1}}


def test_a_restart_brings_back_two_in_one_region_and_none_in_another(lab_database) -> None:  # type: ignore[no-untyped-def]
    first = ensure_fleet([], None, actor="lab")
    assert first.restored == {} and len(first.requested) == 3  # a first start seeds 1 per region
    reshape_to_two_in_frankfurt_none_in_virginia()
    assert live_layout() == KEPT

    stop_local_replicas()  # Ctrl-C
    assert live_layout() == {}
    again = ensure_fleet([], None, actor="lab")  # `make up` with the same var dir

    assert live_layout() == KEPT
    assert again.restored == KEPT
    assert sorted(r.region.code for r in again.requested) == [
        "ap-tokyo", "eu-frankfurt", "eu-frankfurt"]
    # Seeding respects the rows there: another pass requests nothing more.
    assert ensure_fleet([], None, actor="lab").requested == []
    assert live_layout() == KEPT


def test_a_killed_labs_layout_comes_back_and_survives_the_clean_up(lab_database) -> None:  # type: ignore[no-untyped-def]
    ensure_fleet([], None, actor="lab")
    reshape_to_two_in_frankfurt_none_in_virginia()
    stop_local_replicas()
    # The next run starts (the layout comes back), and is killed: its rows are still live.
    ensure_fleet([], None, actor="lab")
    # The start after the kill: the clean-up of leftovers, then the fleet, as the lab does.
    assert len(stop_local_replicas(keep_empty=False)) == 3
    assert stop_local_replicas(keep_empty=False) == []  # nothing live: the kept layout stays
    ensure_fleet([], None, actor="lab")
    assert live_layout() == KEPT


def test_a_number_given_on_the_command_line_sets_the_demo_deployment_again(lab_database) -> None:  # type: ignore[no-untyped-def]
    ensure_fleet([], None, actor="lab")
    reshape_to_two_in_frankfurt_none_in_virginia()
    stop_local_replicas()
    ensure_fleet([], 1, actor="lab")  # --replicas-per-region 1
    assert live_layout() == {DEMO_DEPLOYMENT: {
        "local:eu-frankfurt": 1, "local:us-virginia": 1, "local:ap-tokyo": 1}}

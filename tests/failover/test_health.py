"""Health verdicts: when a probe fails a replica, when a region is down."""

import pytest

from controlplane.failover.health import (
    Probe,
    RegionCounts,
    cut_off_regions,
    region_state,
    replica_verdict,
)


def test_a_refused_probe_fails_at_once_and_a_good_one_clears_the_count():
    assert replica_verdict(Probe(False, detail="refused"), 0) == (True, 0)
    assert replica_verdict(Probe(True), 1) == (False, 0)


def test_timeouts_fail_only_when_two_come_in_a_row():
    failed, count = replica_verdict(Probe(False, timed_out=True), 0)
    assert (failed, count) == (False, 1)
    assert replica_verdict(Probe(False, timed_out=True), count) == (True, 2)


def test_a_timeout_fails_at_once_when_its_whole_region_is_cut_off():
    assert replica_verdict(Probe(False, timed_out=True), 0, region_cut_off=True) == (True, 1)
    assert replica_verdict(Probe(True), 0, region_cut_off=True) == (False, 0)


TIMEOUT, OK, REFUSED = Probe(False, timed_out=True), Probe(True), Probe(False)


def test_a_region_is_cut_off_when_all_its_replicas_time_out_and_another_answers():
    assert cut_off_regions([("fra", TIMEOUT), ("fra", TIMEOUT), ("ams", OK)]) == {"fra"}
    # One replica timing out is a stall, whatever its region holds besides.
    assert cut_off_regions([("fra", TIMEOUT), ("ams", OK)]) == set()
    assert cut_off_regions([("fra", TIMEOUT), ("fra", OK), ("ams", OK)]) == set()
    assert cut_off_regions([("fra", TIMEOUT), ("fra", REFUSED), ("ams", OK)]) == set()
    # Nothing answered anywhere: the control plane's own network may be what failed.
    assert cut_off_regions([("fra", TIMEOUT), ("fra", TIMEOUT), ("ams", TIMEOUT)]) == set()
    assert cut_off_regions([("fra", TIMEOUT), ("fra", TIMEOUT)]) == set()


def test_region_states():
    assert region_state(RegionCounts(serving=2, starting=0, failed_recently=0))[0] == "healthy"
    assert region_state(RegionCounts(0, 0, 0)) == ("idle", "no replicas")
    state, reason = region_state(RegionCounts(1, 0, failed_recently=1, open_incident=True))
    assert state == "degraded" and reason == "1 replica failed recently; 1 serves"
    # Once the failure has been answered (its incident resolved) the region is healthy again.
    assert region_state(RegionCounts(1, 0, failed_recently=1))[0] == "healthy"
    # One lost replica alone is that replica's problem, not the region's.
    assert region_state(RegionCounts(0, 1, failed_recently=1, open_incident=True))[0] == "degraded"
    state, reason = region_state(RegionCounts(serving=0, starting=1, failed_recently=2))
    assert state == "down" and reason == "2 replicas failed and none serves; 1 starting"


def test_a_region_with_nothing_serving_is_not_healthy():
    assert region_state(RegionCounts(0, 0, 0, draining=1)) == (
        "idle", "nothing serves: 1 replica draining")
    assert region_state(RegionCounts(0, 2, 0)) == ("idle", "nothing serves: 2 replicas starting")


def test_a_drilled_region_is_down_once_a_failure_is_seen_whatever_the_count():
    state, reason = region_state(RegionCounts(0, 0, failed_recently=1, open_incident=True,
                                              drill=True))
    assert state == "down" and reason.startswith("drill: 1 replica killed")
    # Something serving there again ends it.
    assert region_state(RegionCounts(1, 0, 1, open_incident=True, drill=True))[0] == "degraded"


def test_failures_past_the_hold_or_older_than_the_regions_newest_replica_do_not_keep_it_down():
    # The hold passed: the region may take replicas again, and says so.
    state, reason = region_state(RegionCounts(0, 0, failed_recently=2, failed_lately=0))
    assert state == "idle" and reason.startswith("recovered from 2 failures")
    # A restarted lab: new replicas start where the last run's failed (they are older).
    assert region_state(RegionCounts(0, 2, failed_recently=2, failed_lately=0))[0] == "idle"


@pytest.mark.parametrize("counts", [
    RegionCounts(serving=1, starting=0, failed_recently=1),
    RegionCounts(serving=2, starting=0, failed_recently=3),
    RegionCounts(0, 0, failed_recently=1),
    RegionCounts(0, 1, failed_recently=1),
    RegionCounts(0, 0, failed_recently=1, draining=1),
    RegionCounts(1, 0, failed_recently=1, open_incident=True),
    RegionCounts(0, 0, failed_recently=2),
])
def test_a_regions_reason_agrees_with_its_failure_count(counts):
    """Frankfurt said "healthy, 1 replica serves" beside failing: 1."""
    state, reason = region_state(counts)
    failed = counts.failed_recently
    assert "failed" in reason and (f"{failed} replica" in reason or f"{failed} failures" in reason), (
        state, reason)


def test_a_healthy_region_with_an_answered_failure_says_so():
    assert region_state(RegionCounts(1, 0, failed_recently=1)) == (
        "healthy", "1 replica serves; 1 replica failed recently (answered)")
    assert region_state(RegionCounts(2, 0, failed_recently=0)) == ("healthy", "2 replicas serve")

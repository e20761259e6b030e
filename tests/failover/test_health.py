"""Health verdicts: when a probe fails a replica, when a region is down."""

from controlplane.failover.health import Probe, RegionCounts, region_state, replica_verdict


def test_a_refused_probe_fails_at_once_and_a_good_one_clears_the_count():
    assert replica_verdict(Probe(False, detail="refused"), 0) == (True, 0)
    assert replica_verdict(Probe(True), 1) == (False, 0)


def test_timeouts_fail_only_when_two_come_in_a_row():
    failed, count = replica_verdict(Probe(False, timed_out=True), 0)
    assert (failed, count) == (False, 1)
    assert replica_verdict(Probe(False, timed_out=True), count) == (True, 2)


def test_region_states():
    assert region_state(RegionCounts(serving=2, starting=0, failed_recently=0))[0] == "healthy"
    assert region_state(RegionCounts(0, 0, 0)) == ("healthy", "no replicas")
    state, reason = region_state(RegionCounts(1, 0, failed_recently=1, open_incident=True))
    assert state == "degraded" and reason == "1 replica failed recently; 1 serves"
    # Once the failure has been answered (its incident resolved) the region is healthy again.
    assert region_state(RegionCounts(1, 0, failed_recently=1))[0] == "healthy"
    # One lost replica alone is that replica's problem, not the region's.
    assert region_state(RegionCounts(0, 1, failed_recently=1, open_incident=True))[0] == "degraded"
    state, reason = region_state(RegionCounts(serving=0, starting=1, failed_recently=2))
    assert state == "down" and reason == "2 replicas failed and none serves; 1 starting"

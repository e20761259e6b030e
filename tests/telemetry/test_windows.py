"""Counters over a window: growth across engine restarts, the readings at its ends, rates."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db.models import QuerySet

from controlplane.routing.models import Edge
from controlplane.telemetry.models import EdgeSample
from controlplane.telemetry.windows import (
    ends,
    from_start,
    grown,
    growth,
    histogram_growth,
    newest,
    oldest,
    per_second,
    rate,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_one_counter_grows_by_the_difference_or_restarts_from_the_new_reading() -> None:
    assert grown(10.0, 4.0) == 6.0
    assert grown(5.0, 5.0) == 0.0
    assert grown(3.0, 40.0) == 3.0  # the engine restarted


def test_growth_sums_each_step_and_counts_a_restart_inside_the_window_from_its_new_start() -> None:
    # 100 → 160, restart, 20 → 50: 60 before the restart, 20 up to the first scrape after
    # it, 30 after; only the ends (100 → 50) would read 50, and max(last - first, 0) 0.
    readings = [{"n": 100.0}, {"n": 160.0}, {"n": 20.0}, {"n": 50.0}]
    assert growth(readings) == {"n": 110.0}
    # After the restart the counter passed its old value: the ends alone would read 20.
    assert growth([{"n": 100.0}, {"n": 30.0}, {"n": 120.0}]) == {"n": 120.0}


def test_growth_keys_and_a_source_that_began_inside_the_window() -> None:
    readings = [{"a": 10.0, "b": 5.0}, {"a": 16.0, "b": 5.0, "c": 2.0}]
    assert growth(readings) == {"a": 6.0, "c": 2.0}  # keys that did not grow are left out
    assert growth(readings, ("a", "z")) == {"a": 6.0}
    assert growth(readings, ("a",), from_zero=True) == {"a": 16.0}
    assert growth(readings[:1]) == {}
    assert growth(readings[:1], from_zero=True) == {"a": 10.0, "b": 5.0}
    assert growth([]) == {}
    # A key gone from the newer reading restarted and has counted nothing since.
    assert growth([{"a": 40.0}, {}]) == {}


def test_histogram_growth_restarts_the_whole_histogram_when_any_bucket_fell() -> None:
    assert histogram_growth([{"1": 2, "+Inf": 2}, {"1": 5, "+Inf": 6}]) == {"1": 3, "+Inf": 4}
    assert histogram_growth([{"1": 2, "+Inf": 9}, {"1": 1, "+Inf": 1}]) == {"1": 1, "+Inf": 1}
    # Empty buckets stay: they bound the quantiles.
    assert histogram_growth([{"0.1": 1, "+Inf": 1}, {"0.1": 1, "+Inf": 4}]) == {"0.1": 0, "+Inf": 3}
    # A restart between the second and third reading: 4 before, 2 + 3 after.
    readings = [{"+Inf": 10}, {"+Inf": 14}, {"+Inf": 2}, {"+Inf": 5}]
    assert histogram_growth(readings) == {"+Inf": 9}
    assert histogram_growth(readings[:1]) == {}


def test_rate_over_the_window_counts_a_restart_inside_it() -> None:
    readings = [(at(0), {"n": 100.0}), (at(30), {"n": 160.0}), (at(45), {"n": 20.0}),
                (at(60), {"n": 50.0})]
    assert rate(readings, "n") == pytest.approx(110.0 / 60)
    assert rate(readings, "missing") == 0.0
    assert rate(readings[:1], "n") == 0.0
    assert rate([(at(0), {"n": 1.0}), (at(0), {"n": 5.0})], "n") == 0.0
    assert per_second(30.0, 60.0) == 0.5 and per_second(30.0, 0.0) == 0.0


def test_from_start_keeps_only_the_newest_reading_at_or_before_the_start() -> None:
    readings = [(at(-90), {"n": 1.0}), (at(-30), {"n": 2.0}), (at(0), {"n": 3.0}),
                (at(10), {"n": 4.0}), (at(20), {"n": 5.0})]
    assert from_start(readings, at(0)) == readings[2:]
    assert from_start(readings, at(-60)) == [readings[0], *readings[1:]]
    assert from_start(readings[3:], at(0)) == readings[3:]  # none before: all inside
    assert from_start([], at(0)) == []


@pytest.mark.django_db
def test_newest_oldest_and_the_two_ends_per_source(catalog) -> None:  # type: ignore[no-untyped-def]
    edges = [Edge.objects.create(name=f"e{i}", region=catalog["fra"],
                                 admin_url=f"http://127.0.0.1:{9000 + i}") for i in range(2)]
    for edge, times in ((edges[0], (0, 30, 60)), (edges[1], (40, 50))):
        for t in times:
            EdgeSample.objects.create(edge=edge, at=at(t), requests={"k": float(t)})
    rows = EdgeSample.objects.all()

    def by_edge(queryset: QuerySet[EdgeSample]) -> dict[int, float]:
        return {edge_id: requests["k"] for edge_id, requests
                in queryset.values_list("edge_id", "requests")}

    e0, e1 = edges[0].pk, edges[1].pk
    assert by_edge(newest(rows, "edge_id")) == {e0: 60.0, e1: 50.0}
    assert by_edge(oldest(rows, "edge_id")) == {e0: 0.0, e1: 40.0}
    start, end = ends(rows, "edge_id", at(35), at(45))
    assert by_edge(start) == {e0: 30.0}  # e1 has no sample at or before the start
    assert by_edge(end) == {e0: 30.0, e1: 40.0}
    assert by_edge(ends(rows, "edge_id", at(35))[1]) == {e0: 60.0, e1: 50.0}


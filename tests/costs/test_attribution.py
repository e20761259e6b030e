"""The pure parts of cost attribution, checked against hand-computed cases."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace

from controlplane.costs import services
from controlplane.costs.services import Share


def t(hour: int, minute: int = 0, second: int = 0, day: int = 20) -> datetime:
    return datetime(2026, 11, day, hour, minute, second, tzinfo=UTC)


def test_a_layout_the_nodes_cannot_hold_has_no_price() -> None:
    # The node count is placement's and provisioning's (deployments.shape.replica_nodes):
    # a TP group wider than a node, or stages that do not split evenly, is never launched.
    eight = SimpleNamespace(on_demand_usd_h=Decimal("98.32"), spot_usd_h=None, gpus_per_node=8)
    assert services.usd_h_for(eight, False, 4, 4) == Decimal("196.64")
    assert services.usd_h_for(eight, False, 4, 3) == 0
    one = SimpleNamespace(on_demand_usd_h=Decimal("2.5"), spot_usd_h=None, gpus_per_node=1)
    assert services.usd_h_for(one, False, 4, 1) == 0


def test_usd_h_is_the_offer_price_per_node_times_nodes() -> None:
    offer = SimpleNamespace(on_demand_usd_h=Decimal("98.32"), spot_usd_h=Decimal("40.00"),
                            gpus_per_node=8)
    assert services.usd_h_for(offer, False, 8, 2) == Decimal("196.64")
    assert services.usd_h_for(offer, True, 8, 2) == Decimal("80.00")
    no_spot = SimpleNamespace(on_demand_usd_h=Decimal("2.5"), spot_usd_h=None, gpus_per_node=1)
    assert services.usd_h_for(no_spot, True, 1, 1) == Decimal("2.5")  # spot asked, none sold
    assert services.usd_h_for(None, False, 1, 1) == Decimal(0)


def test_billed_interval() -> None:
    created, gone, now = t(10), t(11, 30), t(12)
    assert services.billed_interval(created, gone, "terminated", gone, now) == (created, gone)
    assert services.billed_interval(created, None, "ready", created, now) == (created, now)
    assert services.billed_interval(created, None, "draining", t(11), now) == (created, now)
    assert services.billed_interval(created, None, "failed", t(11), now) == (created, t(11))
    assert services.billed_interval(created, None, "pending", created, now) is None


def test_overlap_seconds() -> None:
    assert services.overlap_s(t(9, 30), t(10, 15), t(10), t(11)) == 15 * 60
    assert services.overlap_s(t(9), t(12), t(10), t(11)) == 3600
    assert services.overlap_s(t(11, 5), t(12), t(10), t(11)) == 0
    assert services.overlap_s(t(10, 10), t(10, 20), t(10), t(11)) == 600


def test_split_by_hour_within_one_hour() -> None:
    assert services.split_by_hour(t(10, 1), t(10, 1, 2), 57) == {t(10): 57}
    assert services.split_by_hour(None, t(10, 1), 5) == {t(10): 5}
    assert services.split_by_hour(t(10, 2), t(10, 1), 5) == {t(10): 5}  # clock went back
    assert services.split_by_hour(t(10, 2), t(10, 3), 0) == {}


def test_split_by_hour_across_boundaries_keeps_the_total() -> None:
    # 10:59:59 → 11:00:01: half the interval on each side.
    assert services.split_by_hour(t(10, 59, 59), t(11, 0, 1), 100) == {t(10): 50, t(11): 50}
    # 10:30 → 12:30 is 2 h: a quarter, a half, a quarter.
    assert services.split_by_hour(t(10, 30), t(12, 30), 1000) == {
        t(10): 250, t(11): 500, t(12): 250}
    parts = services.split_by_hour(t(10, 0, 7), t(13, 0, 11), 7)
    assert sum(parts.values()) == 7 and set(parts) <= {t(10), t(11), t(12), t(13)}


def test_usage_rows_sum_prompt_and_completion_per_hour_and_key() -> None:
    deltas = [
        SimpleNamespace(since=t(10, 0, 0), at=t(10, 0, 2), tokens={
            "llama|aws:eu-central-1|acme|prompt": 120.0,
            "llama|aws:eu-central-1|acme|completion": 30.0,
            "llama|aws:eu-central-1|globex|prompt": 5.0,
            "llama|aws:eu-central-1|acme|other": 99.0,   # not a kind we bill
            "|aws:eu-central-1|acme|prompt": 4.0,        # no model: nothing to attribute
        }),
        SimpleNamespace(since=t(10, 0, 2), at=t(10, 0, 4), tokens={
            "llama|aws:eu-central-1|acme|prompt": 80.0,
            "llama|gcp:europe-west4||completion": 9.0,
        }),
    ]
    assert services.usage_rows(deltas) == {
        (t(10), "llama", "aws:eu-central-1", "acme"): [200, 30],
        (t(10), "llama", "aws:eu-central-1", "globex"): [5, 0],
        (t(10), "llama", "gcp:europe-west4", ""): [0, 9],
    }


def test_allocate_shared_cost_by_tokens() -> None:
    # $10 shared; acme served 300 tokens, globex 100 → $7.50 / $2.50.
    shares = services.allocate(Decimal("10"), {}, {"acme": (200, 100), "globex": (100, 0)})
    assert shares == [Share("acme", 200, 100, Decimal("7.500000")),
                      Share("globex", 100, 0, Decimal("2.500000"))]


def test_allocate_rounding_adds_up_exactly() -> None:
    shares = services.allocate(Decimal("1"), {}, {"a": (1, 0), "b": (1, 0), "c": (1, 0)})
    assert sum(s.usd for s in shares) == Decimal("1.000000")
    assert sorted(s.usd for s in shares) == [Decimal("0.333333"), Decimal("0.333333"),
                                             Decimal("0.333334")]


def test_allocate_with_no_tokens_keeps_the_cost_as_idle() -> None:
    assert services.allocate(Decimal("4.2"), {}, {}) == [Share("", 0, 0, Decimal("4.200000"))]
    # A tenant with a row but zero tokens takes no shared cost, and gets no row.
    assert services.allocate(Decimal("1"), {}, {"acme": (0, 0)}) == [
        Share("", 0, 0, Decimal("1.000000"))]


def test_allocate_dedicated_cost_to_its_tenant_whatever_it_used() -> None:
    shares = services.allocate(Decimal("6"), {"acme": Decimal("3")},
                               {"globex": (50, 50), "acme": (0, 0)})
    assert shares == [Share("acme", 0, 0, Decimal("3.000000")),
                      Share("globex", 50, 50, Decimal("6.000000"))]


def test_allocate_tokens_without_cost_still_show() -> None:
    assert services.allocate(Decimal(0), {}, {"acme": (10, 5)}) == [
        Share("acme", 10, 5, Decimal("0.000000"))]


def test_usd_per_mtok() -> None:
    assert services.usd_per_mtok(Decimal("2.5"), 500_000) == 5.0
    assert services.usd_per_mtok(Decimal("2.5"), 0) is None


def test_hours_due_current_and_closed_hours_owed_a_final_pass() -> None:
    now = t(12, 30)
    done = {
        t(11): t(12, 5),     # rolled up after 11:00–12:00 closed plus grace: final
        t(10): t(10, 59),    # last rolled up while open: owed its final pass
        t(9): t(10, 1),      # rolled up within the grace: owed one more
    }
    due = services.hours_due(now, done)
    assert due[-1] == t(12)
    assert t(11) not in due and t(10) in due and t(9) in due
    assert due[0] == now.replace(minute=0) - services.BACKFILL
    assert len(due) == 48 - 1 + 1  # 48 closed hours but one final, and the current hour
    assert all(b - a >= timedelta(hours=1) for a, b in zip(due, due[1:], strict=False))

"""The periodic replan against real Postgres: broken rules, thresholds, superseding, and
automatic application only where every deployment it changes allows it."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import psycopg
import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from controlplane.core.locks import lock_id
from controlplane.core.models import AuditLog
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover.models import Health, RegionHealth
from controlplane.placement.models import ChangeAction, Plan, PlanChange, PlanStatus
from controlplane.placement.proposals import offer_options
from controlplane.plans import apply as plans
from controlplane.plans import tasks
from controlplane.plans.broken_rules import Thresholds, find_broken_rules
from controlplane.plans.replan import ReplanOutcome, replan
from regions.models import Offer, Quota
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db
SEEN = datetime(2026, 11, 1, tzinfo=UTC)


@pytest.fixture
def world(catalog, tenants):  # type: ignore[no-untyped-def]
    """chat-eu: two replicas on Frankfurt's L4 nodes, where the solver puts them today.

    Its engine is pipelined over three stages: 8B at 8,192 tokens × 32 sequences needs three
    L4s, one per single-GPU node."""
    fx = {**catalog, **tenants}
    d = make_deployment(fx, "chat-eu")
    d.min_replicas, d.max_replicas, d.pipeline_parallel = 2, 4, 3
    d.save()
    fra_l4 = Offer.objects.get(region=catalog["fra"], gpu_type=catalog["l4"])
    running = [Replica.objects.create(deployment=d, region=catalog["fra"], offer=fra_l4,
                                      state=S.READY, url=f"http://127.0.0.1:{9000 + i}")
               for i in range(2)]
    return {**fx, "d": d, "fra_l4": fra_l4, "running": running}


def plan_of(outcome: ReplanOutcome) -> Plan:
    """The plan a replan proposed, applied or kept; fails the test where it has none."""
    assert outcome.plan is not None, f"{outcome.action}: {outcome.reason}"
    return outcome.plan


def cheaper_l4(catalog, price: str) -> Offer:  # type: ignore[no-untyped-def]
    return Offer.objects.create(region=catalog["ams"], gpu_type=catalog["l4"], gpus_per_node=1,
                                instance_type="l4x1-new", on_demand_usd_h=Decimal(price),
                                observed_at=SEEN)


def test_nothing_broken_and_nothing_to_save_proposes_nothing(world):  # type: ignore[no-untyped-def]
    outcome = replan()
    assert outcome.action == "none", outcome.reason
    assert outcome.broken == []
    assert outcome.cost_before_usd_h == pytest.approx(4.8)
    assert not Plan.objects.exists()


def test_a_saving_below_the_threshold_proposes_nothing(world, monkeypatch):  # type: ignore[no-untyped-def]
    cheaper_l4(world, "0.30")  # 3 nodes per replica: $0.90/h against $2.40/h
    monkeypatch.setitem(settings.MERIDIAN, "REPLAN_MIN_SAVING_USD_H", 5)
    outcome = replan()
    assert outcome.action == "none" and "below the thresholds" in outcome.reason
    assert outcome.saving_usd_h == pytest.approx(3.0)
    assert not Plan.objects.exists()
    monkeypatch.setitem(settings.MERIDIAN, "REPLAN_MIN_SAVING_USD_H", 1)
    monkeypatch.setitem(settings.MERIDIAN, "REPLAN_MIN_SAVING_FRACTION", 0.7)  # 3.0 of 4.8 is 62%
    assert replan().action == "none"
    assert not Plan.objects.exists()


def test_a_cheaper_offer_is_proposed_and_waits_for_an_operator(world):  # type: ignore[no-untyped-def]
    new = cheaper_l4(world, "0.30")
    outcome = replan()
    assert outcome.action == "proposed", outcome.reason
    plan = plan_of(outcome)
    assert plan.status == PlanStatus.PROPOSED and plan.trigger == "replan:saving"
    assert plan.proposed_by == "system:replan"
    assert float(plan.cost_before_usd_h) == pytest.approx(4.8)
    assert plan.cost_after_usd_h is not None
    assert float(plan.cost_after_usd_h) == pytest.approx(1.8)
    changes = {(c.action, c.offer_id, c.count) for c in plan.changes.all()}
    assert changes == {("add", new.pk, 2), ("remove", world["fra_l4"].pk, 2)}
    assert plan.inputs["replan"]["saving_usd_h"] == pytest.approx(3.0)
    audit = AuditLog.objects.get(action="replan.proposed")
    assert audit.actor == "system:replan" and "saves $3.00/h of $4.80/h" in audit.reason
    assert audit.changes["thresholds"]["min_saving_usd_h"] == 1.0
    assert not Replica.objects.filter(state=S.PENDING).exists()


def test_a_region_going_down_is_proposed_even_at_no_saving(world):  # type: ignore[no-untyped-def]
    now = timezone.now()
    RegionHealth.objects.create(region=world["fra"], state=Health.DOWN, reason="3 of 3 failing",
                                changed_at=now, checked_at=now)
    outcome = replan()
    assert outcome.action == "proposed", outcome.reason
    assert [b.kind for b in outcome.broken] == ["region_down"]
    assert set(outcome.broken[0].replicas) == {r.pk for r in world["running"]}
    plan = plan_of(outcome)
    assert plan.trigger == "replan:region_down"
    removal = plan.changes.get(action=ChangeAction.REMOVE)
    assert removal.region == world["fra"] and removal.count == 2
    assert "is down (3 of 3 failing)" in removal.reason
    adds = plan.changes.filter(action=ChangeAction.ADD)
    assert {c.region for c in adds} == {world["ams"]} and sum(c.count for c in adds) == 2
    assert "is down" in AuditLog.objects.get(action="replan.proposed").reason


def test_auto_apply_only_when_every_deployment_it_changes_allows_it(world, catalog):  # type: ignore[no-untyped-def]
    other = make_deployment(world, "chat-eu-2")
    other.min_replicas = 1
    other.auto_apply_plans = False
    other.save()
    Replica.objects.create(deployment=other, region=catalog["fra"], offer=world["fra_l4"],
                           state=S.READY, url="http://127.0.0.1:9100")
    world["d"].auto_apply_plans = True
    world["d"].save()
    now = timezone.now()
    RegionHealth.objects.create(region=catalog["fra"], state=Health.DOWN, changed_at=now,
                                checked_at=now)

    first = replan()
    assert first.action == "proposed" and "chat-eu-2 apply plans by hand" in first.reason
    assert plan_of(first).status == PlanStatus.PROPOSED
    assert not Replica.objects.filter(state=S.PENDING).exists()

    other.auto_apply_plans = True
    other.save()
    second = replan()  # the same changes: the plan already proposed is applied now
    assert second.action == "applied", second.reason
    assert plan_of(second).pk == plan_of(first).pk and Plan.objects.count() == 1
    plan = Plan.objects.get(pk=plan_of(second).pk)
    assert plan.status == PlanStatus.APPLYING and plan.reviewed_by == "system:replan"
    pending = Replica.objects.filter(state=S.PENDING)
    assert pending.count() == 3 and {r.region_id for r in pending} == {catalog["ams"].pk}
    # make-before-break: nothing in Frankfurt drains before the new replicas serve
    assert Replica.objects.filter(region=catalog["fra"], state=S.READY).count() == 3
    actions = set(AuditLog.objects.filter(actor="system:replan").values_list("action", flat=True))
    assert {"replan.proposed", "plan.approve", "plan.apply"} <= actions
    assert replan().action == "skipped"  # while a plan is applying


def test_newer_plans_supersede_older_ones_and_repeats_are_not_stored(world, catalog):  # type: ignore[no-untyped-def]
    cheaper_l4(catalog, "0.50")
    first = replan()
    assert first.action == "proposed"
    again = replan()
    assert again.action == "unchanged" and plan_of(again).pk == plan_of(first).pk
    assert Plan.objects.count() == 1

    Offer.objects.create(region=catalog["ams"], gpu_type=catalog["l4"], gpus_per_node=1,
                         instance_type="l4x1-cheapest", on_demand_usd_h=Decimal("0.20"),
                         observed_at=SEEN)
    second = replan()
    assert second.action == "proposed" and second.superseded == [plan_of(first).pk]
    old = Plan.objects.get(pk=plan_of(first).pk)
    assert old.status == PlanStatus.SUPERSEDED and old.superseded_by_id == plan_of(second).pk
    assert old.reviewed_by == ""  # superseded, not reviewed
    assert AuditLog.objects.get(action="plan.superseded", object_id=str(old.pk)).reason == (
        f"superseded by plan {plan_of(second).pk}")

    plans.reject(plan_of(second).pk, "alice", "not this week")
    refused = replan()
    assert refused.action == "none" and "alice rejected the same changes" in refused.reason
    assert Plan.objects.count() == 2


def test_a_price_change_since_the_plan_is_a_broken_rule(world, monkeypatch):  # type: ignore[no-untyped-def]
    placed = Plan.objects.create(status=PlanStatus.APPLIED, proposed_by="alice", trigger="manual",
                                 scope=["chat-eu"])
    PlanChange.objects.create(plan=placed, deployment=world["d"], action=ChangeAction.ADD,
                              region=world["fra"], offer=world["fra_l4"], count=2,
                              usd_h_delta=Decimal("4.80"), reason="placed",
                              replica_ids=[r.pk for r in world["running"]])
    monkeypatch.setitem(settings.MERIDIAN, "REPLAN_MIN_SAVING_USD_H", 100)
    assert replan().action == "none"  # same price: nothing broken, saving below threshold

    Offer.objects.filter(pk=world["fra_l4"].pk).update(on_demand_usd_h=Decimal("1.20"))
    outcome = replan()
    assert [b.kind for b in outcome.broken] == ["price"]
    assert "$2.40/h when placed, $3.60/h now" in outcome.broken[0].detail
    assert outcome.action == "proposed" and plan_of(outcome).trigger == "replan:price"


def test_broken_rules_are_found_and_named(world, catalog):  # type: ignore[no-untyped-def]
    d = world["d"]
    iad_l4 = Offer.objects.get(region=catalog["iad"], gpu_type=catalog["l4"])
    us = Replica.objects.create(deployment=d, region=catalog["iad"], offer=iad_l4, state=S.READY)
    orphan = Replica.objects.create(deployment=d, region=catalog["ams"], offer=None,
                                    state=S.STARTING)
    Replica.objects.create(deployment=d, region=catalog["ams"], offer=None, state=S.DRAINING)
    Quota.objects.create(region=catalog["fra"], gpu_type=catalog["l4"], limit_gpus=2,
                         in_use_gpus=0, observed_at=SEEN)
    broken = find_broken_rules([d], offer_options(), Thresholds())
    by_kind = {b.kind: b for b in broken}
    assert set(by_kind) == {"jurisdiction", "offer_missing", "quota"}
    assert by_kind["jurisdiction"].replicas == (us.pk,)
    assert "aws:us-east-1 is outside the jurisdictions chat-eu allows" in (
        by_kind["jurisdiction"].detail)
    assert by_kind["offer_missing"].replicas == (orphan.pk,)  # draining ones are leaving anyway
    # each replica is 3 one-GPU nodes (pipeline parallel) in the capacity model
    assert by_kind["quota"].detail == "aws:eu-central-1 runs 6 L4 GPUs under a quota of 2"
    assert set(by_kind["quota"].replicas) == {r.pk for r in world["running"]}

    catalog["fra"].enabled = False
    catalog["fra"].save()
    broken = find_broken_rules([d], offer_options(), Thresholds())
    disabled = [b for b in broken if b.kind == "region_disabled"]
    assert len(disabled) == 1 and set(disabled[0].replicas) == {r.pk for r in world["running"]}


def test_a_replica_without_an_offer_is_replaced_then_drained(world, catalog):  # type: ignore[no-untyped-def]
    orphan = world["running"][0]
    Replica.objects.filter(pk=orphan.pk).update(offer=None)
    outcome = replan()
    assert outcome.action == "proposed" and plan_of(outcome).trigger == "replan:offer_missing"
    removal = plan_of(outcome).changes.get(action=ChangeAction.REMOVE, offer__isnull=True)
    assert removal.count == 1 and "no offer behind it" in removal.reason
    plans.approve(plan_of(outcome).pk, "alice")
    plans.start_apply(plan_of(outcome).pk, "alice")
    Replica.objects.filter(state=S.PENDING).update(state=S.READY)
    assert plans.advance(plan_of(outcome).pk) == PlanStatus.APPLIED
    assert set(Replica.objects.filter(state=S.DRAINING).values_list("pk", flat=True)) == {
        orphan.pk}


def test_the_task_runs_one_replan_at_a_time(world):  # type: ignore[no-untyped-def]
    params = connection.get_connection_params()
    with psycopg.connect(**{k: v for k, v in params.items() if k in
                            ("dbname", "user", "host", "port", "password")}) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [lock_id("placement.replan")])
        assert tasks.replan()["action"] == "skipped"
        other.execute("SELECT pg_advisory_unlock(%s)", [lock_id("placement.replan")])
    assert tasks.replan() == {"action": "none", "reason": "the fleet is where the solver would "
                              "put it", "plan": None, "broken": [], "superseded": [],
                              "cost_before_usd_h": 4.8, "cost_after_usd_h": 4.8}


def test_the_replan_is_scheduled():  # type: ignore[no-untyped-def]
    from controlplane.core.schedules import SCHEDULES

    (entry,) = [s for s in SCHEDULES if s.task == "placement.replan"]
    assert entry.every_s == 300 and entry.queue == "control"


def test_a_spread_that_failover_lowered_is_restored_once_the_regions_are_usable(world):  # type: ignore[no-untyped-def]
    # Failover put both replicas in Frankfurt while Amsterdam was down; spread asks for two.
    world["d"].spread_regions = 2
    world["d"].save()
    now = timezone.now()
    health = RegionHealth.objects.create(region=world["ams"], state=Health.DOWN, reason="drill",
                                         changed_at=now, checked_at=now)
    # While Amsterdam is down the rule cannot be met, so it is not called broken.
    assert "spread" not in [b.kind for b in find_broken_rules(
        [world["d"]], tuple(o for o in offer_options() if o.region != world["ams"].key),
        Thresholds())]
    health.state = Health.IDLE
    health.save()
    outcome = replan()
    assert [b.kind for b in outcome.broken] == ["spread"], outcome.reason
    assert "spread_regions 2, serving in 1 region (aws:eu-central-1)" in (
        outcome.broken[0].detail)
    assert outcome.plan is not None and outcome.plan.trigger == "replan:spread"
    adds = outcome.plan.changes.filter(action=ChangeAction.ADD)
    assert world["ams"] in {c.region for c in adds}

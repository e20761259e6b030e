"""Property: however proposing, approving and applying plans interleave with replicas
failing or being terminated and with the deployment's rules changing, a plan that is
applied leaves the deployment keeping the rules it was solved for — spread, residency and
replica bounds. A plan computed from a fleet or rules that moved since is refused instead
(409) and changes nothing.

Each example runs in a savepoint that is rolled back, so examples start from the same fleet.
Applying is modelled as one step (start, its new replicas ready, removals drained)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement.basis import counted
from controlplane.placement.models import Plan, PlanStatus
from controlplane.placement.proposals import propose_plan
from controlplane.plans import apply as plans
from regions.models import Offer
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db

# What happens to the fleet between a plan's steps: failover replacing a replica, a replica
# failing or terminated, an operator changing the rules.
MOVES = st.lists(st.one_of(
    st.tuples(st.just("replace"), st.integers(0, 5), st.sampled_from(["fra", "ams", "iad"])),
    st.tuples(st.sampled_from(["fail", "terminate"]), st.integers(0, 5)),
    st.tuples(st.just("spread"), st.integers(1, 3)),
    st.tuples(st.just("residency"), st.sampled_from(["EU", "EU+US"])),
    st.tuples(st.just("bounds"), st.integers(1, 3)),
), max_size=2)


@st.composite
def rounds(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """Propose, approve and apply, each aimed at a plan counted from the newest (0) back,
    with moves of the fleet between them."""
    out: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, 3))):
        out += [("propose",), *draw(MOVES), ("approve", draw(st.integers(0, 1))),
                *draw(MOVES), ("apply", draw(st.integers(0, 1)))]
    return out


STEPS = rounds()


@pytest.fixture
def fleet(catalog, tenants, sent_tasks):  # type: ignore[no-untyped-def]
    d = make_deployment({**catalog, **tenants}, "chat")
    return {**catalog, "d": d}


def start(fx: dict[str, Any]) -> Deployment:
    """Two replicas in Virginia, spread 2 over EU or US regions: the spread rule is broken."""
    d = Deployment.objects.get(pk=fx["d"].pk)
    d.min_replicas, d.max_replicas, d.spread_regions = 2, 3, 2
    d.save()
    d.allowed_jurisdictions.set([fx["eu"], fx["us"]])
    iad = Offer.objects.get(region=fx["iad"], gpu_type=fx["h100"])
    for _ in range(2):
        Replica.objects.create(deployment=d, region=fx["iad"], offer=iad, state=S.READY)
    return d


def broken_rules(d: Deployment) -> list[str]:
    d.refresh_from_db()
    live = list(counted([d.pk]).select_related("region__jurisdiction"))
    allowed = {j.code for j in d.allowed_jurisdictions.all()}
    out = []
    if not d.min_replicas <= len(live) <= d.max_replicas:
        out.append(f"{len(live)} replicas, bounds {d.min_replicas}–{d.max_replicas}")
    if len({r.region_id for r in live}) < min(d.spread_regions, len(live) or 1):
        out.append(f"regions {sorted({r.region.key for r in live})} < spread {d.spread_regions}")
    out += [f"r-{r.pk} in {r.region.jurisdiction.code}" for r in live
            if r.region.jurisdiction.code not in allowed]
    return out


def apply_fully(plan: Plan) -> None:
    plans.start_apply(plan.pk, "ops")
    added = [pk for c in plan.changes.filter(action="add") for pk in c.replica_ids]
    Replica.objects.filter(pk__in=added).update(state=S.READY)
    assert plans.advance(plan.pk) == PlanStatus.APPLIED


def run(fx: dict[str, Any], steps: list[tuple[Any, ...]]) -> None:
    d = start(fx)
    proposed: list[Plan] = []
    for step in steps:
        kind = step[0]
        if kind == "propose":
            proposed.append(propose_plan([d], actor="ops", trigger="manual"))
        elif kind in ("approve", "apply") and proposed:
            plan = proposed[-1 - step[1] % len(proposed)]
            try:
                if kind == "approve":
                    plans.approve(plan.pk, "ops")
                else:
                    apply_fully(plan)
            except plans.PlanStateError:
                continue  # refused: nothing changed
            if kind == "apply" and plan.changes.exists():
                assert broken_rules(d) == [], (f"plan {plan.pk} applied after {steps}: {broken_rules(d)} "
                    f"{[(c.action, c.region_id, c.count) for c in plan.changes.all()]}")
        elif kind in ("fail", "terminate", "replace"):
            live = list(counted([d.pk]).order_by("pk"))
            if live:
                Replica.objects.filter(pk=live[step[1] % len(live)].pk).update(
                    state=S.FAILED if kind == "fail" else S.TERMINATED)
            if kind == "replace":
                region = fx[step[2]]
                Replica.objects.create(deployment=d, region=region, state=S.READY,
                                       offer=Offer.objects.get(region=region, gpu_type=fx["h100"]))
        elif kind == "spread":
            Deployment.objects.filter(pk=d.pk).update(spread_regions=step[1])
        elif kind == "residency":
            d.allowed_jurisdictions.set([fx["eu"]] if step[1] == "EU" else [fx["eu"], fx["us"]])
        elif kind == "bounds":
            Deployment.objects.filter(pk=d.pk).update(min_replicas=step[1], max_replicas=3)


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=STEPS)
def test_an_applied_plan_keeps_the_rules_it_was_solved_for(fleet, steps):  # type: ignore[no-untyped-def]
    with transaction.atomic():
        run(fleet, steps)
        transaction.set_rollback(True)


def test_the_walk_that_found_stale_plans_is_one_of_these_interleavings(fleet):  # type: ignore[no-untyped-def]
    """Plan 1 for the broken spread; its replicas terminated and replaced by failover (one in
    Frankfurt); then plan 1 applied: refused, and the rules hold."""
    with transaction.atomic():
        run(fleet, [("propose",), ("approve", 0), ("terminate", 0), ("terminate", 0)])
        fra = Offer.objects.get(region=fleet["fra"], gpu_type=fleet["h100"])
        iad = Offer.objects.get(region=fleet["iad"], gpu_type=fleet["h100"])
        Replica.objects.create(deployment=fleet["d"], region=fleet["fra"], offer=fra,
                               state=S.READY)
        Replica.objects.create(deployment=fleet["d"], region=fleet["iad"], offer=iad,
                               state=S.READY)
        plan = Plan.objects.filter(scope=["chat"]).get()
        with pytest.raises(plans.PlanStaleError):
            apply_fully(plan)
        assert broken_rules(fleet["d"]) == []
        transaction.set_rollback(True)

"""One deployment that cannot be placed never blocks the others: the fleet plan covers what
can be placed and lists what cannot, with why; and no reason states a negative saving."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.deployments.models import Deployment
from controlplane.placement import explain
from controlplane.placement.problem import PlacementProblem
from controlplane.placement.proposals import propose_plan
from controlplane.placement.search import solve, solve_placeable
from tests.placement.conftest import LLAMA_405B, make_deployment, make_offer


def test_an_unplaceable_deployment_is_listed_and_the_others_are_planned() -> None:
    offers = (make_offer(1, 0), make_offer(2, 1))
    healthy = make_deployment(1, name="demo-chat")
    huge = make_deployment(2, name="huge", model=LLAMA_405B)
    problem = PlacementProblem((healthy, huge), offers)
    assert solve(problem).status == "infeasible"  # as before: one blocks all

    result = solve_placeable(problem)
    assert result.has_plan
    assert {a.deployment_id for a in result.assignments} == {1}
    [(unplaced_id, why)] = result.unplaced
    assert unplaced_id == 2 and "huge:" in why and "does not fit" in why


def test_a_deployment_short_of_quota_alone_does_not_block_the_others() -> None:
    offers = (make_offer(1, 0), make_offer(2, 1))
    healthy = make_deployment(1, name="demo-chat", allowed_jurisdictions=frozenset({"EU"}))
    greedy = make_deployment(2, name="greedy", min_replicas=4, max_replicas=4)
    quota = {("aws:eu-central-1", "H100"): 2, ("gcp:europe-west4", "H100"): 1}
    result = solve_placeable(PlacementProblem((healthy, greedy), offers, quota))
    assert result.has_plan
    assert {a.deployment_id for a in result.assignments} == {1}
    assert [i for i, _ in result.unplaced] == [2]
    assert "quota" in result.unplaced[0][1]


def test_no_reason_states_a_negative_saving() -> None:
    spread = make_deployment(1, spread_regions=2)
    words = explain.remove_reason(spread, "aws:eu-central-1", 1, 2, 2, -1.17, 0.5)
    assert "$-" not in words and "costs $1.17/h more" in words
    assert "spread rule" in words and "saves" not in words
    fewer = explain.remove_reason(make_deployment(2, tokens_per_s=500), "x", 1, 3, 2, -0.4, 0.5,
                                  pool_over_quota=True)
    assert "$-" not in fewer and "costs $0.40/h more" in fewer and "quota" in fewer
    cheaper = explain.remove_reason(make_deployment(3), "x", 1, 1, 1, 2.0, 0.5)
    assert "saves $2.00/h, more than the $0.50/h move penalty" in cheaper


@pytest.mark.django_db
def test_the_fleet_plan_marks_what_it_cannot_place(catalog: dict[str, Any]) -> None:
    from controlplane.deployments.models import Model

    big = Model.objects.create(name="llama-3.1-405b-instruct", hf_id="x", parameters_b=405,
                               layers=126, attention_heads=128, kv_heads=8, head_dim=128,
                               max_context=131072)
    made = []
    for name, model in (("demo-chat", catalog["llama8b"]), ("huge", big)):
        d = Deployment.objects.create(name=name, served_model_name=name, model=model,
                                      min_replicas=1, max_replicas=2)
        d.allowed_jurisdictions.set([catalog["eu"]])
        made.append(d)
    plan = propose_plan(None, actor="ops", trigger="manual")
    assert plan.status == "proposed" and plan.has_plan
    assert {c.deployment.name for c in plan.changes.all()} == {"demo-chat"}
    assert [u["deployment"] for u in plan.unplaced] == ["huge"]
    assert "huge" in plan.explanation
    huge = Deployment.objects.get(name="huge")
    assert huge.placement_status == "unplaceable" and "does not fit" in huge.placement_problem
    assert huge.placement_problem_since is not None
    assert Deployment.objects.get(name="demo-chat").placement_status == "placeable"


@pytest.mark.django_db
def test_an_infeasible_plan_states_no_cost_after(catalog: dict[str, Any]) -> None:
    d = Deployment.objects.create(name="wide", served_model_name="wide",
                                  model=catalog["llama8b"], min_replicas=1, max_replicas=4,
                                  spread_regions=4)
    d.allowed_jurisdictions.set([catalog["eu"]])
    plan = propose_plan([d], actor="ops", trigger="manual")
    assert plan.status == "infeasible"
    plan.refresh_from_db()
    assert plan.cost_after_usd_h is None and plan.saving_usd_h is None
    assert "needs 4 regions" in plan.explanation

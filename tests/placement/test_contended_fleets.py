"""Fleets that contend for quota over several rounds: plans that fit, bounds that hold."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from controlplane.placement import generation
from controlplane.placement.fleet import Fleet
from controlplane.placement.milp import Block, build
from controlplane.placement.problem import OfferOption, PlacementProblem
from controlplane.placement.search import solve
from tests.placement.conftest import H100, L4, L40S, make_deployment, make_offer
from tests.placement.test_solver import assert_obeys_every_rule


def contended_fleet(seed: int, mip_rel_gap: float = 0.005) -> PlacementProblem:
    """40 deployments over 5 sites, 1-, 4- and 8-GPU nodes, quota small enough that the
    deployments' plans alone overrun pools and the joint plans spill into others."""
    rng = random.Random(seed)
    offers: list[OfferOption] = []
    for site in range(5):
        for gpu, base in ((H100, 4.0), (L40S, 1.8), (L4, 0.8)):
            for per_node in (1, 4, 8):
                price = round(base * per_node * rng.uniform(0.8, 1.2), 2)
                spot = round(base * per_node * 0.5, 2) if rng.random() < 0.5 else None
                offers.append(make_offer(len(offers), site, gpu, per_node, price, spot))
    deployments = []
    for i in range(40):
        low = rng.choice((1, 1, 2, 3))
        deployments.append(make_deployment(
            i, min_replicas=low, max_replicas=low + rng.choice((2, 4)),
            allowed_jurisdictions=frozenset(rng.choice(
                (("EU",), ("EU", "UK"), ("US", "EU"), ("EU", "UK", "US")))),
            tokens_per_s=float(rng.choice((0, 1000, 3000))),
            spread_regions=rng.choice((1, 1, 2)), max_spot_fraction=rng.choice((0.0, 0.5)),
            tensor_parallel=rng.choice((1, 2, 4)), pipeline_parallel=rng.choice((1, 1, 2))))
    quota = {(o.region, o.gpu.name): rng.choice((8, 16, 32, 64)) for o in offers}
    return PlacementProblem(tuple(deployments), tuple(offers), quota, mip_rel_gap=mip_rel_gap,
                            time_limit_s=60)


@pytest.mark.parametrize("seed", [0, 1, 3, 6, 7])
def test_contended_fleets_fit_and_their_bounds_hold(seed: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    joint_solves = []
    real = generation._solve_part

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        joint_solves.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "_solve_part", counted)
    problem = contended_fleet(seed)
    result = solve(problem)
    assert joint_solves  # quota binds: not settled from the plans alone
    assert result.status == "optimal", result.explanation
    assert_obeys_every_rule(problem, result)
    assert result.lp_bound_usd_h is not None
    assert result.gap_to_lp_bound is not None
    assert result.gap_to_lp_bound <= problem.mip_rel_gap + 1e-9
    # Against a plan solved (nearly) exactly: each bound is below the other's plan.
    exact = solve(contended_fleet(seed, mip_rel_gap=1e-6))
    assert exact.lp_bound_usd_h is not None
    assert result.lp_bound_usd_h <= exact.objective_usd_h + 1e-6
    assert exact.lp_bound_usd_h <= result.objective_usd_h + 1e-6
    assert exact.objective_usd_h <= result.objective_usd_h + 1e-6 + 1e-6 * exact.objective_usd_h


@pytest.mark.parametrize("seed", [0, 3, 6])
def test_a_plan_to_start_from_is_a_feasible_point_of_the_joint_model(seed: int) -> None:
    problem = contended_fleet(seed)
    result = solve(problem)
    fleet = Fleet.prepare(problem)
    blocks = []
    for d in problem.deployments:
        b = fleet.blocks[d.id]
        index = {(c.offer.id, c.spot): j for j, c in enumerate(b.cands)}
        start = {index[(a.offer_id, a.spot)]: a.count
                 for a in result.assignments if a.deployment_id == d.id}
        blocks.append(Block(b.d, b.cands, b.running, start=start))
    m = build(blocks, problem.quota, problem.move_penalty_usd_h)
    assert m.start is not None
    x = m.start
    assert np.all(x >= m.lower - 1e-9) and np.all(x <= m.upper + 1e-9)
    assert np.all(np.abs(x[m.integer] - np.round(x[m.integer])) < 1e-9)
    rows = m.matrix @ x
    assert np.all(rows >= m.row_lower - 1e-6) and np.all(rows <= m.row_upper + 1e-6)
    assert math.isclose(float(m.cost @ x), result.objective_usd_h, rel_tol=1e-9, abs_tol=1e-6)

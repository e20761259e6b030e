"""The solver: rules never broken (hypothesis), optimal on small cases, explained failures."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.placement.capacity import GpuSpec, ModelSpec
from controlplane.placement.solver import (
    DeploymentRequest,
    ExistingReplicas,
    OfferOption,
    PlacementProblem,
    candidates_for,
    solve,
)

H100 = GpuSpec("H100", 80, 3350)
L40S = GpuSpec("L40S", 48, 864)
LLAMA_8B = ModelSpec("llama-3.1-8b", 8.03, 32, 32, 8, 128)
SITES = [  # region, cloud, jurisdiction, lat, lon
    ("aws:eu-central-1", "aws", "EU", 50.1, 8.7), ("gcp:europe-west4", "gcp", "EU", 53.4, 6.8),
    ("aws:us-east-1", "aws", "US", 38.9, -77.4), ("azure:uksouth", "azure", "UK", 51.5, -0.1),
]


def offer(i: int, site: int, gpu: GpuSpec = H100, per_node: int = 1, price: float = 4.0,
          spot: float | None = 2.0) -> OfferOption:
    region, cloud, jur, lat, lon = SITES[site]
    return OfferOption(i, region, cloud, jur, gpu, per_node, price, spot, lat, lon)


def deployment(i: int = 1, **kw) -> DeploymentRequest:  # type: ignore[no-untyped-def]
    base = dict(id=i, name=f"d{i}", model=LLAMA_8B, context=4096, tokens_per_s=0.0,
                min_replicas=1, max_replicas=4, allowed_jurisdictions=frozenset({"EU"}))
    base.update(kw)
    return DeploymentRequest(**base)


def test_picks_cheapest_allowed_offer_and_explains_it():
    offers = (offer(1, 0, price=5.0), offer(2, 1, price=3.0), offer(3, 2, price=1.0))
    result = solve(PlacementProblem((deployment(),), offers, {}))
    assert result.status == "optimal"
    assert [(a.offer_id, a.count) for a in result.assignments] == [(2, 1)]
    assert "gcp:europe-west4" in result.changes[0].reason and "EU" in result.changes[0].reason


def test_spread_over_two_regions():
    offers = (offer(1, 0, price=5.0), offer(2, 1, price=3.0))
    result = solve(PlacementProblem((deployment(spread_regions=2, min_replicas=2),), offers, {}))
    assert sorted(a.offer_id for a in result.assignments) == [1, 2]


def test_existing_replica_is_kept_when_moving_saves_less_than_the_penalty():
    offers = (offer(1, 0, price=4.0), offer(2, 1, price=3.9))
    existing = (ExistingReplicas(1, 1, False, 1),)
    kept = solve(PlacementProblem((deployment(),), offers, {}, existing, move_penalty_usd_h=0.5))
    assert [(a.offer_id, a.count) for a in kept.assignments] == [(1, 1)] and kept.changes == []
    moved = solve(PlacementProblem((deployment(),), offers, {}, existing, move_penalty_usd_h=0.01))
    assert {(c.action, c.offer_id) for c in moved.changes} == {("add", 2), ("remove", 1)}


def test_quota_infeasibility_names_the_binding_quota():
    offers = (offer(1, 0), offer(2, 1))
    quota = {("aws:eu-central-1", "H100"): 2, ("gcp:europe-west4", "H100"): 2}
    result = solve(PlacementProblem((deployment(min_replicas=8, max_replicas=8),), offers, quota))
    assert result.status == "infeasible" and result.assignments == []
    assert result.explanation == [
        "EU has 4 GPUs left under quota across the offers d1 may use; it needs at least 8 H100"]


def test_shared_quota_infeasibility_names_the_deployments():
    offers = (offer(1, 0),)
    quota = {("aws:eu-central-1", "H100"): 3}
    deps = (deployment(1, min_replicas=2), deployment(2, min_replicas=2))
    result = solve(PlacementProblem(deps, offers, quota))
    assert result.status == "infeasible"
    assert "EU has 3 GPUs (H100) left under quota; deployments d1, d2 need at least 4 together" \
        in result.explanation


def test_no_offer_in_jurisdiction_is_explained():
    result = solve(PlacementProblem((deployment(allowed_jurisdictions=frozenset({"JP"})),),
                                    (offer(1, 0),), {}))
    assert result.status == "infeasible"
    assert result.explanation[0].startswith("d1: no offer in JP fits llama-3.1-8b")


def test_far_offers_are_excluded_by_the_ttft_slo():
    # Users in Frankfurt, SLO 100 ms: 50 ms of network budget; Virginia is ~65 ms away.
    d = deployment(allowed_jurisdictions=frozenset({"EU", "US"}), ttft_slo_ms=100,
                   user_locations=((50.1, 8.7),))
    regions = {c.offer.region for c in candidates_for(d, (offer(1, 0), offer(2, 2)), {})}
    assert regions == {"aws:eu-central-1"}


# -- properties -------------------------------------------------------------------------------

offers_strategy = st.lists(
    st.builds(lambda site, gpu, per, price, spot: (site, gpu, per, price, spot),
              st.integers(0, 3), st.sampled_from([H100, L40S]), st.sampled_from([1, 2, 4]),
              st.integers(1, 40), st.one_of(st.none(), st.floats(0.2, 0.9))),
    min_size=1, max_size=6,
)
deps_strategy = st.lists(
    st.builds(lambda jur, lo, extra, spread, spot, demand: (jur, lo, extra, spread, spot, demand),
              st.sets(st.sampled_from(["EU", "US", "UK"]), min_size=1),
              st.integers(0, 3), st.integers(0, 3), st.integers(1, 2),
              st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from([0, 2000, 8000])),
    min_size=1, max_size=3,
)


def build(offer_specs, dep_specs, quota_cap):  # type: ignore[no-untyped-def]
    offers = tuple(
        offer(i, site, gpu, per, float(price), None if spot is None else round(price * spot, 2))
        for i, (site, gpu, per, price, spot) in enumerate(offer_specs)
    )
    deps = tuple(
        deployment(i, allowed_jurisdictions=frozenset(jur), min_replicas=lo,
                   max_replicas=max(lo + extra, 1), spread_regions=spread,
                   max_spot_fraction=spot, tokens_per_s=float(demand))
        for i, (jur, lo, extra, spread, spot, demand) in enumerate(dep_specs)
    )
    quota = {(o.region, o.gpu.name): quota_cap for o in offers}
    return PlacementProblem(deps, offers, quota, time_limit_s=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(offers_strategy, deps_strategy, st.integers(1, 12))
def test_plans_never_break_residency_quota_minimum_or_spot(offer_specs, dep_specs, cap):  # type: ignore[no-untyped-def]
    problem = build(offer_specs, dep_specs, cap)
    result = solve(problem)
    if result.status == "infeasible":
        assert result.assignments == [] and result.explanation
        return
    offers = {o.id: o for o in problem.offers}
    used: dict[tuple[str, str], int] = {}
    for d in problem.deployments:
        mine = [a for a in result.assignments if a.deployment_id == d.id]
        total = sum(a.count for a in mine)
        assert d.min_replicas <= total <= d.max_replicas
        assert all(offers[a.offer_id].jurisdiction in d.allowed_jurisdictions for a in mine)
        assert sum(a.count for a in mine if a.spot) <= d.max_spot_fraction * total + 1e-9
        if total:
            assert len({offers[a.offer_id].region for a in mine}) >= min(d.spread_regions, total) \
                or d.spread_regions == 1
    for a in result.assignments:
        pool = (offers[a.offer_id].region, offers[a.offer_id].gpu.name)
        used[pool] = used.get(pool, 0) + a.gpus
    assert all(n <= problem.quota_gpus[p] for p, n in used.items())


@settings(max_examples=25, deadline=None)
@given(offers_strategy, st.integers(0, 3), st.integers(1, 2))
def test_solver_cost_equals_brute_force_on_small_cases(offer_specs, low, spread):  # type: ignore[no-untyped-def]
    problem = build(offer_specs, [({"EU", "US", "UK"}, low, 1, spread, 0.5, 0)], 6)
    result = solve(problem)
    cands = candidates_for(problem.deployments[0], problem.offers, {})
    d = problem.deployments[0]
    best = None
    for counts in itertools.product(range(d.max_replicas + 1), repeat=len(cands)):
        total = sum(counts)
        if not d.min_replicas <= total <= d.max_replicas:
            continue
        if sum(n for n, c in zip(counts, cands, strict=True) if c.spot) > d.max_spot_fraction * total:
            continue
        if total and len({c.offer.region for n, c in zip(counts, cands, strict=True) if n}) < d.spread_regions:
            continue
        gpus: dict[tuple[str, str], int] = {}
        for n, c in zip(counts, cands, strict=True):
            key = (c.offer.region, c.offer.gpu.name)
            gpus[key] = gpus.get(key, 0) + n * c.gpus
        if any(v > problem.quota_gpus[k] for k, v in gpus.items()):
            continue
        cost = sum(n * c.usd_h for n, c in zip(counts, cands, strict=True))
        best = cost if best is None else min(best, cost)
    if best is None:
        assert result.status == "infeasible"
    else:
        assert result.status != "infeasible"
        assert result.cost_after_usd_h == pytest.approx(best, abs=1e-6)

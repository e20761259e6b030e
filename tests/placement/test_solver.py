"""The solver: cheapest plans, the reasons given, and rules no plan ever breaks."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.placement.candidates import candidates_for
from controlplane.placement.capacity import replica_shape
from controlplane.placement.greedy import place_greedy
from controlplane.placement.problem import (
    NETWORK_SHARE_OF_TTFT,
    ExistingReplica,
    PlacementProblem,
    QuotaLimit,
)
from controlplane.placement.result import PlacementResult
from controlplane.placement.search import solve
from regions.geo import great_circle_km, rtt_ms
from tests.placement.conftest import (
    FRANKFURT,
    H100,
    L4,
    L40S,
    LLAMA_8B,
    LLAMA_405B,
    make_deployment,
    make_offer,
)

EXACT = 1e-9  # mip_rel_gap for comparisons with brute force


def test_picks_the_cheapest_allowed_offer_and_says_why(offer, deployment):
    offers = (offer(1, 0, price=5.0), offer(2, 1, price=3.0), offer(3, 2, price=1.0))
    result = solve(PlacementProblem((deployment(),), offers))
    assert result.status == "optimal"
    assert [(a.offer_id, a.count) for a in result.assignments] == [(2, 1)]
    (change,) = result.changes
    assert (change.action, change.count, change.region) == ("add", 1, "gcp:europe-west4")
    assert "EU, allowed for d1" in change.reason and "cheapest allowed option" in change.reason
    assert result.cost_after_usd_h == 3.0 and result.lp_bound_usd_h == pytest.approx(3.0)


def test_spreads_over_two_regions_even_when_one_is_dearer(offer, deployment):
    offers = (offer(1, 0, price=5.0), offer(2, 1, price=3.0))
    result = solve(PlacementProblem((deployment(spread_regions=2, min_replicas=2),), offers))
    assert sorted(a.offer_id for a in result.assignments) == [1, 2]
    dear = next(c for c in result.changes if c.offer_id == 1)
    assert "spreads d1 over 2 regions" in dear.reason


def test_spreads_over_two_clouds(offer, deployment):
    offers = (offer(1, 0, price=1.0), offer(2, 4, price=2.0), offer(3, 1, price=3.0))
    result = solve(PlacementProblem((deployment(spread_clouds=2, min_replicas=2),), offers))
    # Two replicas on the $1 offer would be cheapest, but both would be on aws.
    assert sorted(a.offer_id for a in result.assignments) == [1, 2]
    assert {a.region.split(":")[0] for a in result.assignments} == {"aws", "gcp"}


def test_meets_demand_with_headroom_at_least_cost(offer, deployment):
    # One H100 makes ~2,609 tok/s for $4, one L40S ~785 for $1.50; 3,000 × 1.2 = 3,600
    # to cover. Two H100s cost $8, five L40S $7.50, one H100 and two L40S $7.
    offers = (offer(1, 0, H100, price=4.0, spot=None), offer(2, 1, L40S, price=1.5, spot=None))
    d = deployment(tokens_per_s=3000.0, min_replicas=1, max_replicas=10)
    result = solve(PlacementProblem((d,), offers, mip_rel_gap=EXACT))
    assert sorted((a.offer_id, a.count) for a in result.assignments) == [(1, 1), (2, 2)]
    assert result.cost_after_usd_h == pytest.approx(7.0)


def test_spot_share_stays_under_its_limit(offer, deployment):
    offers = (offer(1, 0, price=4.0, spot=1.0),)
    d = deployment(min_replicas=4, max_replicas=4, max_spot_fraction=0.5)
    result = solve(PlacementProblem((d,), offers))
    assert sorted((a.spot, a.count) for a in result.assignments) == [(False, 2), (True, 2)]
    assert result.cost_after_usd_h == 10.0


def test_a_running_replica_stays_when_moving_saves_less_than_the_penalty(offer, deployment):
    offers = (offer(1, 0, price=4.0), offer(2, 1, price=3.9))
    running = (ExistingReplica(1, 1, False, 1),)
    kept = solve(PlacementProblem((deployment(),), offers, {}, running, move_penalty_usd_h=0.5))
    assert [(a.offer_id, a.count) for a in kept.assignments] == [(1, 1)]
    assert kept.changes == () and kept.cost_before_usd_h == kept.cost_after_usd_h == 4.0


def test_a_running_replica_moves_when_the_saving_beats_the_penalty(offer, deployment):
    offers = (offer(1, 0, price=4.0), offer(2, 1, price=3.9))
    running = (ExistingReplica(1, 1, False, 1),)
    moved = solve(PlacementProblem((deployment(),), offers, {}, running,
                                   move_penalty_usd_h=0.01))
    assert {(c.action, c.offer_id) for c in moved.changes} == {("add", 2), ("remove", 1)}
    removal = next(c for c in moved.changes if c.action == "remove")
    assert "saves $0.10/h" in removal.reason and removal.usd_h_delta == -4.0
    assert moved.objective_usd_h == pytest.approx(3.9 + 0.01)


def test_a_replica_outside_the_allowed_jurisdictions_is_removed(offer, deployment):
    offers = (offer(1, 0), offer(2, 2))
    running = (ExistingReplica(1, 2, False, 1),)
    result = solve(PlacementProblem((deployment(),), offers, {}, running))
    removal = next(c for c in result.changes if c.action == "remove")
    assert removal.offer_id == 2
    assert "aws:us-east-1 is in US, outside the jurisdictions d1 allows (EU)" in removal.reason
    assert all(a.offer_id == 1 for a in result.assignments)


def test_a_replica_on_a_withdrawn_offer_is_removed(offer, deployment):
    running = (ExistingReplica(1, 99, False, 2, usd_h=3.0),)
    result = solve(PlacementProblem((deployment(),), (offer(1, 0),), {}, running))
    removal = next(c for c in result.changes if c.action == "remove")
    assert removal.count == 2 and "no longer listed" in removal.reason
    assert result.cost_before_usd_h == 6.0 and removal.usd_h_delta == -6.0


def test_fewer_replicas_when_demand_falls(offer, deployment):
    running = (ExistingReplica(1, 1, False, 3),)
    result = solve(PlacementProblem((deployment(min_replicas=1),), (offer(1, 0),), {}, running))
    (change,) = result.changes
    assert (change.action, change.count) == ("remove", 2)
    assert "need 1 replicas, not 3" in change.reason


def test_far_offers_are_excluded_by_the_ttft_slo(offer, deployment):
    # Users in Frankfurt, SLO 100 ms: 50 ms for the network; Virginia is ~65 ms away.
    d = deployment(allowed_jurisdictions=frozenset({"EU", "US"}), ttft_slo_ms=100,
                   user_locations=(FRANKFURT,))
    regions = {c.offer.region for c in candidates_for(d, (offer(1, 0), offer(2, 2)))}
    assert regions == {"aws:eu-central-1"}


def test_a_deployment_allowed_to_scale_to_zero_gets_nothing(offer, deployment):
    result = solve(PlacementProblem((deployment(min_replicas=0, spread_regions=2),),
                                    (offer(1, 0),)))
    assert result.status == "optimal" and result.assignments == ()


def test_pipelined_replicas_pay_for_every_node(offer, deployment):
    d = deployment(model=LLAMA_405B, context=8192, batch=16, max_replicas=2, tensor_parallel=8,
                   pipeline_parallel=2)
    result = solve(PlacementProblem((d,), (offer(1, 0, H100, per_node=8, price=50.0),)))
    (a,) = result.assignments
    assert (a.gpus, a.usd_h, a.tensor_parallel, a.pipeline_parallel, a.nodes) == (
        16, 100.0, 8, 2, 2)
    assert "tp 8, pp 2 over 2 nodes" in result.changes[0].reason


# -- the engine as launched: the deployment's TP × PP -----------------------------------------

def test_offers_whose_nodes_cannot_hold_the_configured_engine_are_not_used(offer, deployment):
    # TP 2 needs two GPUs in one node: the cheap single-H100 nodes cannot run it, though
    # the model would fit one H100 at TP 1.
    offers = (offer(1, 0, H100, per_node=1, price=2.0), offer(2, 1, H100, per_node=2, price=7.0))
    d = deployment(tensor_parallel=2)
    result = solve(PlacementProblem((d,), offers))
    (a,) = result.assignments
    assert (a.offer_id, a.tensor_parallel, a.gpus, a.usd_h) == (2, 2, 2, 7.0)
    shape = replica_shape(LLAMA_8B, H100, 2, 4096, tensor_parallel=2, pipeline_parallel=1)
    assert shape is not None
    (change,) = result.changes
    assert "(tp 2)" in change.reason and f"~{shape.tokens_per_s:,.0f} tok/s" in change.reason


def test_a_bigger_node_is_not_counted_as_several_engines(offer, deployment):
    # One engine per replica: an 8×H100 node at TP 1 serves what one H100 serves, so seven
    # single-H100 replicas ($28/h) meet 15,000 × 1.2 tok/s, not one 8-GPU node ($20/h).
    offers = (offer(1, 0, H100, per_node=8, price=20.0, spot=None),
              offer(2, 1, H100, per_node=1, price=4.0, spot=None))
    d = deployment(tokens_per_s=15000.0, max_replicas=10)
    result = solve(PlacementProblem((d,), offers, mip_rel_gap=EXACT))
    assert [(a.offer_id, a.count) for a in result.assignments] == [(2, 7)]
    assert result.cost_after_usd_h == pytest.approx(28.0)


def test_no_node_holding_the_engine_is_explained(offer, deployment):
    d = deployment(tensor_parallel=4)
    result = solve(PlacementProblem((d,), (offer(1, 0, H100, per_node=2),)))
    assert result.status == "infeasible"
    (why,) = result.explanation
    assert "its engine (tp 4)" in why and "2× H100 nodes cannot hold d1's engine" in why


def test_a_running_replica_whose_nodes_cannot_hold_the_engine_is_replaced(offer, deployment):
    # Runs on single-H100 nodes from before its TP was raised to 2.
    offers = (offer(1, 0, H100, per_node=1, price=2.0), offer(2, 1, H100, per_node=2, price=7.0))
    running = (ExistingReplica(1, 1, False, 1),)
    result = solve(PlacementProblem((deployment(tensor_parallel=2),), offers, {}, running))
    assert {(c.action, c.offer_id) for c in result.changes} == {("add", 2), ("remove", 1)}
    removal = next(c for c in result.changes if c.action == "remove")
    assert "1× H100 nodes cannot hold d1's engine (tp 2" in removal.reason


def test_quota_rows_are_accepted_as_quota_limits(offer, deployment):
    offers = (offer(1, 0, price=1.0), offer(2, 1, price=2.0))
    limits = [QuotaLimit("aws:eu-central-1", "H100", 1)]
    result = solve(PlacementProblem((deployment(min_replicas=2),), offers, limits))
    assert sorted((a.offer_id, a.count) for a in result.assignments) == [(1, 1), (2, 1)]


def test_shared_quota_goes_where_it_saves_most(offer, deployment):
    # One cheap H100 left in Frankfurt. d1 (listed first) could use gcp at +$0.50/h;
    # d2 may only use Frankfurt or a $10 L40S. Placing d1 first (greedy) costs $9.50 more.
    offers = (offer(1, 0, price=1.0, spot=None), offer(2, 1, price=1.5, spot=None),
              offer(3, 0, L40S, price=10.0, spot=None))
    d1 = deployment(1)
    d2 = deployment(2, allowed_regions=frozenset({"aws:eu-central-1"}))
    quota = {("aws:eu-central-1", "H100"): 1}
    problem = PlacementProblem((d1, d2), offers, quota, mip_rel_gap=EXACT)
    result = solve(problem)
    assert {(a.deployment_id, a.offer_id) for a in result.assignments} == {(1, 2), (2, 1)}
    assert result.cost_after_usd_h == 2.5
    greedy = place_greedy(problem)
    assert greedy.cost_after_usd_h == 11.0


def test_a_whole_fleet_is_planned_or_none_of_it(offer, deployment):
    deps = (deployment(1), deployment(2, allowed_jurisdictions=frozenset({"JP"})))
    result = solve(PlacementProblem(deps, (offer(1, 0),)))
    assert result.status == "infeasible" and result.assignments == () and result.changes == ()
    assert result.explanation == ("d2: no offer in JP, the only places its data may go",)


# -- rules no plan breaks (hypothesis) --------------------------------------------------------

offer_specs = st.lists(
    st.tuples(st.integers(0, 4), st.sampled_from([H100, L40S, L4]), st.sampled_from([1, 2, 4]),
              st.integers(1, 40), st.one_of(st.none(), st.floats(0.2, 0.9))),
    min_size=1, max_size=6,
)
# Engine layouts of llama-3.1-8b (32 heads, 8 KV heads, 32 layers) that deployments set.
LAYOUTS = [(1, 1), (1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]
deployment_specs = st.lists(
    st.tuples(st.sets(st.sampled_from(["EU", "US", "UK"]), min_size=1),  # jurisdictions
              st.integers(0, 3), st.integers(0, 2),  # min replicas, extra allowed
              st.integers(1, 2), st.integers(1, 2),  # spread regions, clouds
              st.sampled_from([0.0, 0.5, 1.0]),  # spot share
              st.sampled_from([0.0, 2000.0, 6000.0]),  # demand
              st.sampled_from([None, 60.0, 200.0]),  # TTFT SLO with users in Frankfurt
              st.lists(st.tuples(st.integers(0, 5), st.booleans(), st.integers(1, 2)),
                       max_size=2),  # running: (offer index, spot, count)
              st.sampled_from(LAYOUTS)),  # the engine's (tp, pp)
    min_size=1, max_size=3,
)


def build(offers_in, deployments_in, cap):  # type: ignore[no-untyped-def]
    offers = tuple(
        make_offer(i, site, gpu, per_node, float(price),
                   None if spot is None else round(price * spot, 2))
        for i, (site, gpu, per_node, price, spot) in enumerate(offers_in))
    deployments = []
    running = []
    for i, (jur, low, extra, regions, clouds, spot, demand, slo, existing, (tp, pp)) in (
            enumerate(deployments_in)):
        deployments.append(make_deployment(
            i, allowed_jurisdictions=frozenset(jur), min_replicas=low,
            max_replicas=max(low + extra, 1), spread_regions=regions, spread_clouds=clouds,
            max_spot_fraction=spot, tokens_per_s=demand,
            ttft_slo_ms=slo or 1000.0, user_locations=(FRANKFURT,) if slo else (),
            tensor_parallel=tp, pipeline_parallel=pp))
        running += [ExistingReplica(i, o, s, n) for o, s, n in existing]
    quota = {(o.region, o.gpu.name): cap for o in offers} if cap else {}
    return PlacementProblem(tuple(deployments), offers, quota, tuple(running),
                            time_limit_s=20, mip_rel_gap=EXACT)


def assert_obeys_every_rule(problem: PlacementProblem, result: PlacementResult,
                            with_changes: bool = True) -> None:
    offers = {o.id: o for o in problem.offers}
    used: dict[tuple[str, str], int] = defaultdict(int)
    for d in problem.deployments:
        mine = [a for a in result.assignments if a.deployment_id == d.id]
        total = sum(a.count for a in mine)
        assert d.min_replicas <= total <= d.max_replicas, d
        rate = 0.0
        for a in mine:
            o = offers[a.offer_id]
            assert o.jurisdiction in d.allowed_jurisdictions, (d, o)  # residency
            assert not d.allowed_regions or o.region in d.allowed_regions
            for lat, lon in d.user_locations:  # latency
                rtt = rtt_ms(great_circle_km(lat, lon, o.latitude, o.longitude))
                assert rtt <= d.ttft_slo_ms * NETWORK_SHARE_OF_TTFT
            shape = replica_shape(d.model, o.gpu, o.gpus_per_node, d.context, d.batch,
                                  tensor_parallel=d.tensor_parallel,
                                  pipeline_parallel=d.pipeline_parallel)
            assert shape is not None  # its nodes hold the deployment's engine, which fits
            assert (a.tensor_parallel, a.pipeline_parallel, a.nodes) == (
                d.tensor_parallel, d.pipeline_parallel, shape.nodes)  # as launched
            assert a.gpus == a.count * shape.gpus
            rate += a.count * shape.tokens_per_s
            used[(o.region, o.gpu.name)] += a.gpus
            assert not a.spot or o.spot_usd_h is not None
        assert rate >= d.required_tokens_per_s - 1e-6
        assert sum(a.count for a in mine if a.spot) <= d.max_spot_fraction * total + 1e-9
        if d.must_run:
            assert len({offers[a.offer_id].region for a in mine}) >= d.spread_regions
            assert len({offers[a.offer_id].cloud for a in mine}) >= d.spread_clouds
    for pool, n in used.items():
        assert n <= problem.quota.get(pool, math.inf), pool
    if not with_changes:
        return
    # Changes turn what runs into the plan.
    plan: dict[tuple[int, int, bool], int] = defaultdict(int)
    for e in problem.existing:
        plan[(e.deployment_id, e.offer_id, e.spot)] += e.count
    for c in result.changes:
        plan[(c.deployment_id, c.offer_id, c.spot)] += c.count if c.action == "add" else -c.count
    assert {k: n for k, n in plan.items() if n} == {
        (a.deployment_id, a.offer_id, a.spot): a.count for a in result.assignments}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(offer_specs, deployment_specs, st.one_of(st.none(), st.integers(1, 12)))
def test_no_plan_breaks_residency_latency_quota_replicas_demand_spread_or_spot(
        offers_in, deployments_in, cap):  # type: ignore[no-untyped-def]
    problem = build(offers_in, deployments_in, cap)
    result = solve(problem)
    if result.status == "infeasible":
        assert result.assignments == () and result.changes == () and result.explanation
        return
    assert_obeys_every_rule(problem, result)
    assert result.lp_bound_usd_h is not None
    assert result.lp_bound_usd_h <= result.objective_usd_h + 1e-6


# -- optimal on small cases (brute force) -----------------------------------------------------

def brute_force(problem: PlacementProblem) -> float | None:
    """The least objective over every plan, built from the rules, not from the solver."""
    per_deployment = []
    for d in problem.deployments:
        options = []
        for o in problem.offers:
            if o.jurisdiction not in d.allowed_jurisdictions:
                continue
            if any(rtt_ms(great_circle_km(lat, lon, o.latitude, o.longitude))
                   > d.ttft_slo_ms * NETWORK_SHARE_OF_TTFT for lat, lon in d.user_locations):
                continue
            shape = replica_shape(d.model, o.gpu, o.gpus_per_node, d.context, d.batch,
                                  tensor_parallel=d.tensor_parallel,
                                  pipeline_parallel=d.pipeline_parallel)
            if shape is None:
                continue
            options.append((o, False, shape, o.on_demand_usd_h * shape.nodes))
            if o.spot_usd_h is not None:
                options.append((o, True, shape, o.spot_usd_h * shape.nodes))
        running: dict[tuple[int, bool], int] = defaultdict(int)
        for e in problem.existing:
            if e.deployment_id == d.id:
                running[(e.offer_id, e.spot)] += e.count
        plans = []
        for counts in itertools.product(range(d.max_replicas + 1), repeat=len(options)):
            total = sum(counts)
            if not d.min_replicas <= total <= d.max_replicas:
                continue
            chosen = [(opt, n) for opt, n in zip(options, counts, strict=True) if n]
            if sum(n * opt[2].tokens_per_s for opt, n in chosen) < d.required_tokens_per_s:
                continue
            if sum(n for opt, n in chosen if opt[1]) > d.max_spot_fraction * total + 1e-9:
                continue
            if d.must_run and (len({opt[0].region for opt, _ in chosen}) < d.spread_regions
                               or len({opt[0].cloud for opt, _ in chosen}) < d.spread_clouds):
                continue
            kept = {(opt[0].id, opt[1]): n for opt, n in chosen}
            removed = sum(max(n - kept.get(key, 0), 0) for key, n in running.items())
            cost = sum(n * opt[3] for opt, n in chosen) + removed * problem.move_penalty_usd_h
            usage: dict[tuple[str, str], int] = defaultdict(int)
            for opt, n in chosen:
                usage[opt[0].pool] += n * opt[2].gpus
            plans.append((cost, usage))
        per_deployment.append(plans)
    best = None
    for combo in itertools.product(*per_deployment):
        usage = defaultdict(int)
        for _, u in combo:
            for pool, n in u.items():
                usage[pool] += n
        if any(n > problem.quota.get(pool, math.inf) for pool, n in usage.items()):
            continue
        cost = sum(c for c, _ in combo)
        best = cost if best is None else min(best, cost)
    return best


small_offers = st.lists(
    st.tuples(st.integers(0, 4), st.sampled_from([H100, L40S]), st.sampled_from([1, 2]),
              st.integers(1, 20), st.one_of(st.none(), st.floats(0.3, 0.8))),
    min_size=1, max_size=3,
)
small_deployments = st.lists(
    st.tuples(st.sets(st.sampled_from(["EU", "US", "UK"]), min_size=1),
              st.integers(0, 2), st.integers(0, 1), st.integers(1, 2), st.integers(1, 2),
              st.sampled_from([0.0, 0.5]), st.sampled_from([0.0, 3000.0]),
              st.sampled_from([None, 60.0]),
              st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(1, 2)),
                       max_size=1),
              st.sampled_from([(1, 1), (2, 1), (1, 2)])),
    min_size=1, max_size=2,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_offers, small_deployments, st.one_of(st.none(), st.integers(1, 6)))
def test_cost_equals_brute_force_on_small_fleets(offers_in, deployments_in, cap):  # type: ignore[no-untyped-def]
    problem = build(offers_in, deployments_in, cap)
    best = brute_force(problem)
    result = solve(problem)
    if best is None:
        assert result.status == "infeasible" and result.explanation
    else:
        assert result.status == "optimal", result.explanation
        assert result.objective_usd_h == pytest.approx(best, abs=1e-6)
        assert result.lp_bound_usd_h == pytest.approx(best, abs=1e-4)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(offer_specs, deployment_specs, st.one_of(st.none(), st.integers(1, 12)))
def test_never_costlier_than_placing_one_deployment_at_a_time(offers_in, deployments_in, cap):  # type: ignore[no-untyped-def]
    problem = build(offers_in, deployments_in, cap)
    greedy = place_greedy(problem)
    if greedy.status == "infeasible":
        return
    assert_obeys_every_rule(problem, greedy, with_changes=False)
    result = solve(problem)
    assert result.status != "infeasible"
    # The baseline ignores running replicas; compare the $/h of the plans themselves.
    if not problem.existing:
        assert result.cost_after_usd_h <= greedy.cost_after_usd_h + 1e-6

"""The scheduling pipeline: table-driven cases (candidates, request, expected pick, why), and
the residency invariant under generated tables, tenants and health."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.health import ReplicaStats
from edge.local import build_table
from edge.policy import (
    PickerState,
    RouteRequest,
    candidate_set,
    pick_common,
    schedule,
    schedule_set,
)
from edge.prefix import PrefixIndex, block_keys
from edge.table import Replica, TenantRules, parse_table

from .conftest import replica

NOW = 1000.0
PROMPT = "system\x1fYou are the support assistant of a shipping company.\x1e" * 8


def replicas(*entries: dict[str, Any]) -> tuple[Replica, ...]:
    return parse_table(build_table(1, "e", {"m": list(entries)}, {})).models["m"]


def rules(jurisdictions: tuple[str, ...] = ("EU",), **extra: Any) -> TenantRules:
    return TenantRules(tenant=extra.pop("tenant", "acme"), jurisdictions=frozenset(jurisdictions),
                       **extra)


def policy(**extra: Any) -> Any:
    document = build_table(1, "e", {}, {}, policy={
        "scorers": extra.pop("scorers", {"latency": 1.0, "load": 2.0, "prefix": 3.0,
                                         "cost": 0.5}), **extra})
    return parse_table(document).policy


@dataclass
class Case:
    why: str
    candidates: tuple[Replica, ...]
    expected: str  # a replica id, or the reason nothing was picked
    tenant: TenantRules = field(default_factory=rules)
    tier: str = "interactive"
    stats: dict[str, ReplicaStats] = field(default_factory=dict)
    policy: Any = None
    prompt_on: str | None = None  # a replica already sent PROMPT


CASES = [
    Case("residency excludes a closer replica in another jurisdiction",
         replicas(replica("us", jurisdiction="US", rtt_ms=1), replica("eu", rtt_ms=80)), "eu"),
    Case("with all else equal, the lower round-trip time wins",
         replicas(replica("far", rtt_ms=50), replica("near", rtt_ms=5)), "near"),
    Case("load outweighs a modest latency advantage",
         replicas(replica("near", rtt_ms=5, max_inflight=64), replica("idle", rtt_ms=20)),
         "idle", stats={"near": ReplicaStats(inflight=60)}),
    Case("the engine's queue and KV usage count as load",
         replicas(replica("busy"), replica("calm")), "calm",
         stats={"busy": ReplicaStats(waiting=40, kv_usage=0.95)}),
    Case("an ejected replica is skipped",
         replicas(replica("ejected", rtt_ms=1), replica("ok", rtt_ms=60)), "ok",
         stats={"ejected": ReplicaStats(ejected_until=NOW + 5)}),
    Case("an ejection that has run out no longer excludes",
         replicas(replica("back", rtt_ms=1), replica("ok", rtt_ms=60)), "back",
         stats={"back": ReplicaStats(ejected_until=NOW - 1, ejections=1)}),
    Case("a replica whose /health probe fails is skipped",
         replicas(replica("down", rtt_ms=1), replica("ok", rtt_ms=60)), "ok",
         stats={"down": ReplicaStats(probe_ok=False)}),
    Case("allowed replicas all down: residency_unavailable, never the healthy US one",
         replicas(replica("us", jurisdiction="US"), replica("eu")), "residency_unavailable",
         stats={"eu": ReplicaStats(probe_ok=False)}),
    Case("all replicas down for a tenant allowed everywhere: no_healthy_replica",
         replicas(replica("a"), replica("b", jurisdiction="US")), "no_healthy_replica",
         tenant=rules(("EU", "US")),
         stats={"a": ReplicaStats(probe_ok=False), "b": ReplicaStats(probe_ok=False)}),
    Case("a tenant with no jurisdiction in common gets residency_unavailable",
         replicas(replica("us", jurisdiction="US")), "residency_unavailable"),
    Case("a draining replica takes no new requests",
         replicas(replica("draining", state="draining", rtt_ms=1), replica("ok", rtt_ms=90)),
         "ok"),
    Case("weight 0 takes no new requests",
         replicas(replica("zero", weight=0.0, rtt_ms=1), replica("ok", rtt_ms=90)), "ok"),
    Case("a degraded replica (weight 0.5) loses to a ready one",
         replicas(replica("degraded", weight=0.5, state="degraded"), replica("ready")), "ready"),
    Case("every candidate at max in-flight: wait for capacity",
         replicas(replica("a", max_inflight=2)), "at_capacity",
         stats={"a": ReplicaStats(inflight=2)}),
    Case("batch requests may fill only a share of an interactive replica",
         replicas(replica("a", max_inflight=10)), "at_capacity", tier="batch",
         stats={"a": ReplicaStats(inflight=5)}),
    Case("interactive requests may use the rest of it",
         replicas(replica("a", max_inflight=10)), "a", stats={"a": ReplicaStats(inflight=5)}),
    Case("batch replicas take no interactive requests",
         replicas(replica("batch", tier="batch")), "no_replicas"),
    Case("batch requests use batch replicas",
         replicas(replica("batch", tier="batch", rtt_ms=30), replica("inter", rtt_ms=30)),
         "batch", tier="batch", stats={"inter": ReplicaStats(inflight=3)}),
    Case("a replica dedicated to another tenant is not a candidate",
         replicas(replica("theirs", tenant="globex", rtt_ms=1), replica("shared", rtt_ms=90)),
         "shared"),
    Case("a replica dedicated to this tenant is",
         replicas(replica("mine", tenant="acme", rtt_ms=1), replica("shared", rtt_ms=90)),
         "mine"),
    Case("a tenant narrowed to regions stays in them",
         replicas(replica("fra", region="aws:eu-central-1", rtt_ms=1),
                  replica("dub", region="aws:eu-west-1", rtt_ms=40)), "dub",
         tenant=rules(regions=frozenset({"aws:eu-west-1"}))),
    Case("the replica that holds the prompt's prefix wins over an idle one",
         replicas(replica("warm"), replica("cold")), "warm", prompt_on="warm",
         stats={"warm": ReplicaStats(inflight=2)}),
    Case("a hot prefix spills over once its replica is past the load bound",
         replicas(replica("warm"), replica("cold")), "cold", prompt_on="warm",
         stats={"warm": ReplicaStats(inflight=9)}),
    Case("with cost alone weighed, the cheaper replica wins",
         replicas(replica("dear", usd_per_mtok=0.9), replica("cheap", usd_per_mtok=0.2)),
         "cheap", policy=policy(scorers={"cost": 1.0})),
    Case("a score tie goes to the less loaded of the two",
         replicas(replica("a"), replica("b")), "b", policy=policy(scorers={"latency": 1.0}),
         stats={"a": ReplicaStats(inflight=3), "b": ReplicaStats(inflight=1)}),
    Case("no replicas at all",
         (), "no_replicas"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.why for c in CASES])
def test_pick(case: Case) -> None:
    index = PrefixIndex()
    keys = block_keys(PROMPT)
    if case.prompt_on:
        index.record(keys, case.prompt_on)
    decision = schedule(case.candidates, case.tenant, RouteRequest("m", case.tier, keys, 100),
                        case.stats, case.policy or policy(), NOW, index,
                        PickerState(random.Random(7)))
    picked = decision.replica.id if decision.replica else decision.reason
    assert picked == case.expected, f"{case.why}: scores {decision.scores}"


def test_round_robin_cycles_through_candidates() -> None:
    cset = candidate_set(replicas(replica("a"), replica("b"), replica("c")), rules(),
                         "interactive", policy(picker="round_robin"), "m")
    state = PickerState()
    picks = [schedule_set(cset, RouteRequest("m"), {}, NOW, None, state).replica for _ in range(6)]
    assert [r.id for r in picks if r] == ["a", "b", "c", "a", "b", "c"]


def test_retries_exclude_replicas_already_tried() -> None:
    cset = candidate_set(replicas(replica("a", rtt_ms=1), replica("b", rtt_ms=50)), rules(),
                         "interactive", policy(), "m")
    first = schedule_set(cset, RouteRequest("m"), {}, NOW)
    second = schedule_set(cset, RouteRequest("m"), {}, NOW, exclude={"a"})
    third = schedule_set(cset, RouteRequest("m"), {}, NOW, exclude={"a", "b"})
    assert (first.replica and first.replica.id, second.replica and second.replica.id,
            third.replica) == ("a", "b", None)


def test_new_prefixes_spread_and_repeat_prefixes_stick() -> None:
    """Without history, distinct prompts spread over replicas by rendezvous hashing; a prompt
    seen before goes back where it went."""
    cset = candidate_set(replicas(*(replica(f"r{i}") for i in range(4))), rules(),
                         "interactive", policy(scorers={"prefix": 3.0, "load": 1.0}), "m")
    index = PrefixIndex()
    homes = {}
    for n in range(40):
        keys = block_keys(f"system\x1fAssistant persona number {n}. " * 10)
        decision = schedule_set(cset, RouteRequest("m", prefix=keys), {}, NOW, index)
        assert decision.replica is not None
        index.record(keys, decision.replica.id)
        homes[n] = decision.replica.id
    assert len(set(homes.values())) == 4
    for n in range(40):
        keys = block_keys(f"system\x1fAssistant persona number {n}. " * 10)
        again = schedule_set(cset, RouteRequest("m", prefix=keys), {}, NOW, index)
        assert again.replica is not None and again.replica.id == homes[n]


# --- residency never fails open ------------------------------------------------------------

JURISDICTIONS = ["EU", "US", "UK", "IN", "JP"]
REGIONS = ["aws:eu-central-1", "aws:us-east-1", "gcp:europe-west2", "azure:centralindia",
           "gcp:asia-northeast1"]

replica_entries = st.builds(
    lambda i, j, region, state, weight, tier, tenant, rtt, cost, limit: replica(
        f"r{i}", jurisdiction=j, region=region, state=state, weight=weight, tier=tier,
        tenant=tenant, rtt_ms=rtt, usd_per_mtok=cost, max_inflight=limit),
    st.integers(0, 10_000), st.sampled_from(JURISDICTIONS), st.sampled_from(REGIONS),
    st.sampled_from(["ready", "degraded", "draining"]), st.sampled_from([0.0, 0.5, 1.0]),
    st.sampled_from(["interactive", "batch"]), st.sampled_from([None, "acme", "globex"]),
    st.floats(0, 300), st.one_of(st.none(), st.floats(0, 5)), st.integers(1, 8),
)
stats_values = st.builds(
    ReplicaStats, inflight=st.integers(0, 10), probe_ok=st.booleans(),
    ejected_until=st.sampled_from([0.0, NOW - 1, NOW + 10]), waiting=st.floats(0, 50),
    kv_usage=st.floats(0, 1), running=st.floats(0, 20))
tenants = st.builds(
    lambda js, regions, tier: TenantRules("acme", frozenset(js), frozenset(regions), tier=tier),
    st.sets(st.sampled_from(JURISDICTIONS + ["*"]), max_size=3),
    st.sets(st.sampled_from(REGIONS), max_size=2), st.sampled_from(["interactive", "batch"]))


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(replica_entries, max_size=8, unique_by=lambda e: e["id"]),
       tenant=tenants, stats=st.lists(stats_values, min_size=8, max_size=8),
       picker=st.sampled_from(["max_score", "round_robin", "random"]),
       tier=st.sampled_from(["interactive", "batch"]), prompt_on=st.integers(0, 7),
       seed=st.integers(0, 2**16))
def test_no_pick_is_ever_outside_the_tenants_jurisdictions(
        entries: list[dict[str, Any]], tenant: TenantRules, stats: list[ReplicaStats],
        picker: str, tier: str, prompt_on: int, seed: int) -> None:
    candidates = replicas(*entries)
    by_id = {r.id: s for r, s in zip(candidates, stats, strict=False)}
    index = PrefixIndex()
    keys = block_keys(PROMPT)
    if candidates:
        index.record(keys, candidates[prompt_on % len(candidates)].id)
    decision = schedule(candidates, tenant, RouteRequest("m", tier, keys, 10), by_id,
                        policy(picker=picker), NOW, index, PickerState(random.Random(seed)))
    chosen = decision.replica
    if chosen is None:
        assert decision.reason in {"no_replicas", "residency_unavailable",
                                   "no_healthy_replica", "at_capacity"}
        return
    assert "*" in tenant.jurisdictions or chosen.jurisdiction in tenant.jurisdictions
    assert not tenant.regions or chosen.region in tenant.regions
    assert chosen.tenant in (None, tenant.tenant)
    chosen_stats = by_id[chosen.id]
    assert chosen_stats.probe_ok and chosen_stats.ejected_until <= NOW
    assert chosen.state != "draining" and chosen.weight > 0


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(replica_entries, min_size=1, max_size=8, unique_by=lambda e: e["id"]),
       tenant=tenants, stats=st.lists(stats_values, min_size=8, max_size=8),
       healthy=st.booleans(), tier=st.sampled_from(["interactive", "batch"]),
       prompt_on=st.integers(0, 7), prompt=st.sampled_from(["", "short", PROMPT]),
       scorers=st.sampled_from([None, {"load": 1.0, "prefix": 1.0}, {"prefix": 2.0, "load": 1.0}]),
       seed=st.integers(0, 2**16))
def test_the_flat_common_pick_agrees_with_the_pipeline(
        entries: list[dict[str, Any]], tenant: TenantRules, stats: list[ReplicaStats],
        healthy: bool, tier: str, prompt_on: int, prompt: str,
        scorers: dict[str, float] | None, seed: int) -> None:
    """`pick_common` either declines or picks exactly what `schedule_set` picks, random
    tie-breaks included."""
    if healthy:
        for s in stats:
            s.probe_ok, s.ejected_until, s.inflight = True, 0.0, 0
    candidates = replicas(*entries)
    by_id = {r.id: s for r, s in zip(candidates, stats, strict=False)}
    table_policy = policy(scorers=scorers) if scorers else policy()
    cset = candidate_set(candidates, tenant, tier, table_policy, "m")
    index = PrefixIndex()
    keys = block_keys(prompt)
    index.record(keys, candidates[prompt_on % len(candidates)].id)
    fast = pick_common(cset, keys, by_id, NOW, index, PickerState(random.Random(seed)))
    if fast is None:
        return
    general = schedule_set(cset, RouteRequest("m", tier, keys, 10), by_id, NOW, index,
                           PickerState(random.Random(seed)))
    assert general.replica is fast

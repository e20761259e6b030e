"""Usage upserts and hourly rollups against real Postgres."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace

import pytest
from django.db import connection
from django.db.models import Sum

from controlplane.costs import budgets, services
from controlplane.costs.models import CostRollup, RollupHour, TokenUsage
from controlplane.deployments.models import Replica

H10 = datetime(2026, 11, 20, 10, tzinfo=UTC)
FRA, IAD = "aws:eu-central-1", "aws:us-east-1"
FRA_H100 = Decimal("12.29")  # the fixture catalog's price


def delta(at: datetime, tokens: dict[str, float], seconds: float = 2.0) -> SimpleNamespace:
    return SimpleNamespace(edge_id=1, since=at - timedelta(seconds=seconds), at=at,
                           requests={}, tokens=tokens)


def rows(hour: datetime = H10) -> dict[tuple[str, str, str], tuple[int, int, Decimal]]:
    return {(r.model, r.region, r.tenant): (r.prompt_tokens, r.completion_tokens, r.usd)
            for r in CostRollup.objects.filter(hour=hour)}


@pytest.mark.django_db
def test_record_usage_adds_repeated_deltas() -> None:
    at = H10 + timedelta(minutes=5)
    for i in range(3):
        services.record_usage([delta(at + timedelta(seconds=2 * i), {
            f"llama|{FRA}|acme|prompt": 100.0, f"llama|{FRA}|acme|completion": 10.0})])
    services.record_usage([delta(at, {f"llama|{FRA}|globex|completion": 7.0}),
                           delta(at, {f"llama|{FRA}|globex|completion": 3.0})])
    usage = {(u.tenant, u.prompt_tokens, u.completion_tokens) for u in TokenUsage.objects.all()}
    assert usage == {("acme", 300, 30), ("globex", 0, 10)}
    assert services.record_usage([]) == 0


@pytest.mark.django_db
def test_record_usage_splits_a_delta_across_the_hour_boundary() -> None:
    services.record_usage([delta(H10 + timedelta(seconds=1), {f"llama|{FRA}|acme|prompt": 40.0},
                                 seconds=3)])
    got = dict(TokenUsage.objects.values_list("hour", "prompt_tokens"))
    assert got == {H10 - timedelta(hours=1): 27, H10: 13}


@pytest.mark.django_db(transaction=True)
def test_record_usage_from_two_workers_at_once_counts_both() -> None:
    at = H10 + timedelta(minutes=1)
    keys = {f"m{i}|{FRA}|acme|prompt": 1.0 for i in range(50)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work() -> None:
        try:
            barrier.wait()
            for _ in range(10):
                services.record_usage([delta(at, keys)])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=work) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert TokenUsage.objects.count() == 50
    assert TokenUsage.objects.aggregate(n=Sum("prompt_tokens"))["n"] == 50 * 20


@pytest.mark.django_db
def test_rollup_allocates_by_tokens_and_keeps_idle_cost(tenants, make_deployment, make_replica) -> None:  # type: ignore[no-untyped-def]
    shared = make_deployment("chat")
    # Fra: one replica the whole hour, another from 10:30 → 1.5 × $12.29.
    make_replica(shared, "fra", H10 - timedelta(hours=2))
    make_replica(shared, "fra", H10 + timedelta(minutes=30))
    # Iad: a replica terminated at 10:15 and nobody's tokens → idle 0.25 × $11.06.
    make_replica(shared, "iad", H10 - timedelta(hours=1), state="terminated",
                 terminated=H10 + timedelta(minutes=15))
    # Replicas outside the hour, pending, or long failed cost nothing here.
    make_replica(shared, "fra", H10 - timedelta(hours=3), state="terminated",
                 terminated=H10 - timedelta(minutes=1))
    make_replica(shared, "fra", H10 + timedelta(minutes=10), state="pending")
    make_replica(shared, "fra", H10 - timedelta(hours=3), state="failed",
                 changed=H10 - timedelta(minutes=5))
    services.record_usage([delta(H10 + timedelta(minutes=20), {
        f"llama-3.1-8b|{FRA}|acme|prompt": 600.0, f"llama-3.1-8b|{FRA}|acme|completion": 150.0,
        f"llama-3.1-8b|{FRA}|globex|completion": 250.0})])
    marker = services.rollup_hour(H10, now=H10 + timedelta(hours=1, minutes=5))

    fra_cost = FRA_H100 * Decimal("1.5")
    got = rows()
    assert got == {
        ("llama-3.1-8b", FRA, "acme"): (600, 150, (fra_cost * Decimal("0.75")).quantize(
            services.USD_PLACES)),
        ("llama-3.1-8b", FRA, "globex"): (0, 250, (fra_cost * Decimal("0.25")).quantize(
            services.USD_PLACES)),
        ("llama-3.1-8b", IAD, ""): (0, 0, Decimal("11.06") / 4),
    }
    assert marker.usd == fra_cost + Decimal("11.06") / 4
    assert marker.tokens == 1000


@pytest.mark.django_db
def test_rollup_of_the_current_hour_counts_up_to_now(tenants, make_deployment, make_replica) -> None:  # type: ignore[no-untyped-def]
    make_replica(make_deployment("chat"), "fra", H10 - timedelta(hours=1))
    services.rollup_hour(H10, now=H10 + timedelta(minutes=12))
    assert rows() == {("llama-3.1-8b", FRA, ""): (0, 0, FRA_H100 / 5)}


@pytest.mark.django_db
def test_rollup_prices_spot_and_multi_node_replicas(tenants, make_deployment, make_replica) -> None:  # type: ignore[no-untyped-def]
    big = make_deployment("big", served="big", tp=1, pp=4)  # 4 stages on 1-GPU nodes: 4 nodes
    make_replica(big, "fra", H10 - timedelta(hours=1), spot=True)
    # TP 2 cannot run on 1-GPU nodes: never launched, so nothing is billed for it.
    wide = make_deployment("wide", served="wide", tp=2, pp=2)
    make_replica(wide, "fra", H10 - timedelta(hours=1))
    services.rollup_hour(H10, now=H10 + timedelta(hours=2))
    assert rows() == {("big", FRA, ""): (0, 0, FRA_H100 / 2 * 4)}
    replica = Replica.objects.annotate(usd_h=services.replica_usd_h_sql()).get(deployment=big)
    assert replica.usd_h == services.usd_h_for(replica.offer, True, 1, 4) == FRA_H100 * 2
    replica = Replica.objects.annotate(usd_h=services.replica_usd_h_sql()).get(deployment=wide)
    assert replica.usd_h is None and services.usd_h_for(replica.offer, False, 2, 2) == 0


@pytest.mark.django_db
def test_dedicated_deployment_cost_goes_to_its_tenant(tenants, make_deployment, make_replica) -> None:  # type: ignore[no-untyped-def]
    mine = make_deployment("acme-chat", tenant=tenants["acme"])
    make_replica(mine, "fra", H10 - timedelta(hours=1))
    services.record_usage([delta(H10 + timedelta(minutes=1), {
        f"llama-3.1-8b|{FRA}|globex|prompt": 10.0})])
    services.rollup_hour(H10, now=H10 + timedelta(hours=2))
    assert rows() == {("llama-3.1-8b", FRA, "acme"): (0, 0, FRA_H100),
                      ("llama-3.1-8b", FRA, "globex"): (10, 0, Decimal(0))}
    assert budgets.month_to_date_usd("acme", now=H10 + timedelta(hours=2)) == float(FRA_H100)


@pytest.mark.django_db
def test_rollup_is_idempotent_and_rewrites_the_hour(tenants, make_deployment, make_replica) -> None:  # type: ignore[no-untyped-def]
    make_replica(make_deployment("chat"), "fra", H10 - timedelta(hours=1))
    services.record_usage([delta(H10 + timedelta(minutes=1), {
        f"llama-3.1-8b|{FRA}|acme|prompt": 10.0})])
    later = H10 + timedelta(hours=1, minutes=3)
    services.rollup_hour(H10, now=later)
    first = rows()
    services.rollup_hour(H10, now=later)
    assert rows() == first and CostRollup.objects.count() == 1
    assert RollupHour.objects.get(hour=H10).usd == FRA_H100
    # Tokens that arrive later move cost from acme to both: the hour is rewritten.
    services.record_usage([delta(H10 + timedelta(minutes=59), {
        f"llama-3.1-8b|{FRA}|globex|prompt": 30.0})])
    services.rollup_hour(H10, now=later)
    got = rows()
    assert got[("llama-3.1-8b", FRA, "acme")][2] == (FRA_H100 / 4).quantize(services.USD_PLACES)
    assert sum(v[2] for v in got.values()) == FRA_H100


@pytest.mark.django_db
def test_rollup_due_rolls_owed_hours_once(tenants, make_deployment, make_replica) -> None:  # type: ignore[no-untyped-def]
    make_replica(make_deployment("chat"), "fra", H10 - timedelta(hours=2))
    now = H10 + timedelta(hours=1, minutes=10)
    hours = services.rollup_due(now)
    assert hours[-1] == H10 + timedelta(hours=1) and H10 in hours
    assert len(hours) == 49
    # The second pass only redoes the current hour: every closed hour had its final pass.
    assert services.rollup_due(now + timedelta(minutes=1)) == [H10 + timedelta(hours=1)]
    assert rows() == {("llama-3.1-8b", FRA, ""): (0, 0, FRA_H100)}
    assert rows(H10 - timedelta(hours=2)) == {("llama-3.1-8b", FRA, ""): (0, 0, FRA_H100)}
    assert rows(H10 - timedelta(hours=3)) == {}



@pytest.mark.django_db
def test_rollup_task_rolls_up_owed_hours(tenants, make_deployment, make_replica) -> None:  # type: ignore[no-untyped-def]
    from controlplane.costs import tasks

    make_replica(make_deployment("chat"), "fra", H10)
    assert tasks.rollup() == {"hours": 49}
    assert RollupHour.objects.count() == 49
    assert tasks.rollup() == {"hours": 1}


@pytest.mark.django_db(transaction=True)
def test_rollup_task_skips_while_another_worker_holds_the_lock() -> None:
    from controlplane.core.locks import advisory_lock
    from controlplane.costs import tasks

    held, done = threading.Event(), threading.Event()

    def other_worker() -> None:
        try:
            with advisory_lock("costs.rollup") as acquired:
                assert acquired
                held.set()
                done.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=other_worker)
    thread.start()
    try:
        assert held.wait(10)
        assert tasks.rollup() == {"skipped": 1}
    finally:
        done.set()
        thread.join()
    assert tasks.rollup() == {"hours": 49}

"""The autoscaler against real Postgres: stored samples in, decisions and replica requests out.
Celery is the boundary: tasks are recorded instead of sent."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.core.models import AuditLog, Tier
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.scaling import autoscaler
from controlplane.scaling.models import ScalingDecision
from controlplane.telemetry.models import EdgeSample, ReplicaSample
from regions.models import Offer, Quota

pytestmark = pytest.mark.django_db

SentTask = tuple[str, tuple[Any, ...], dict[str, Any]]


@pytest.fixture(autouse=True)
def sent_tasks(monkeypatch: pytest.MonkeyPatch) -> list[SentTask]:
    from celery.app.task import Task

    sent: list[SentTask] = []

    def apply_async(self: Task, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        sent.append((self.name, tuple(args or ()), dict(options)))

    monkeypatch.setattr(Task, "apply_async", apply_async)
    return sent


def make_deployment(catalog: dict[str, Any], name: str = "chat", **fields: Any) -> Deployment:
    defaults = {"served_model_name": name, "model": catalog["llama8b"], "min_replicas": 1,
                "max_replicas": 6, "target_inflight_per_replica": 24, "slo_ttft_p95_ms": 800}
    d = Deployment.objects.create(name=name, **{**defaults, **fields})
    d.allowed_jurisdictions.set([catalog["eu"]])
    d.user_regions.set([catalog["fra"]])
    return d


def ready_replicas(d: Deployment, region: Any, n: int, gpu: Any) -> list[Replica]:
    offer = Offer.objects.get(region=region, gpu_type=gpu)
    return [Replica.objects.create(deployment=d, region=region, offer=offer, state=S.READY,
                                   url=f"http://127.0.0.1:{9100 + i}") for i in range(n)]


def recorded(outcome: autoscaler.Outcome) -> ScalingDecision:
    """The decision a round recorded; fails the test where it recorded none."""
    assert outcome.recorded is not None, f"no decision recorded: {outcome.decision}"
    return outcome.recorded


def store_rounds(replicas: list[Replica], seconds: float, *, end: Any = None,
                 **values: float) -> None:
    """Samples every 2 s over the last `seconds` for each replica, as telemetry.collect does."""
    end = end or timezone.now()
    rows = []
    for i in range(int(seconds // 2) + 1):
        at = end - timedelta(seconds=seconds - 2 * i)
        rows += [ReplicaSample(replica=r, at=at, up=True, **values) for r in replicas]
    ReplicaSample.objects.bulk_create(rows)


def test_a_sustained_queue_scales_up_through_the_solver(  # type: ignore[no-untyped-def]
        catalog, sent_tasks, django_capture_on_commit_callbacks):
    d = make_deployment(catalog)
    replicas = ready_replicas(d, catalog["fra"], 2, catalog["h100"])
    store_rounds(replicas, 6, running=20, waiting=8, kv_usage=0.6)

    with django_capture_on_commit_callbacks(execute=True):
        [outcome] = autoscaler.run()

    decision = recorded(outcome)
    assert decision is not None and decision.direction == "up"
    assert (decision.replicas_before, decision.replicas_after) == (2, 3)
    assert "queue 8.0 waiting/replica" in decision.reason
    assert decision.signals["waiting"] == 16 and decision.signals["serving"] == 2
    assert decision.signals["sustained_s"]["queue"] >= 4
    assert decision.signals["placement"].startswith("solver:")
    # Of the kind already running (H100, not the cheaper L4), the solver's cheapest in the EU
    # is GCP's Eemshaven: placed there, never in the US.
    assert decision.placed == ["gcp:europe-west4"]
    new = Replica.objects.get(deployment=d, state=S.PENDING)
    assert new.region == catalog["ams"] and new.offer is not None
    assert new.offer.gpu_type == catalog["h100"]
    assert [t for t in sent_tasks if t[0] == "provisioning.provision_replica"] == [
        ("provisioning.provision_replica", (new.pk,), {})]
    audit = AuditLog.objects.get(action="deployment.scale_up")
    assert audit.changes["replicas"] == [2, 3] and audit.changes["placed"] == ["gcp:europe-west4"]

    # The same breach, with the new replica still starting: no second decision.
    store_rounds(replicas, 0, running=20, waiting=8, kv_usage=0.6)
    assert [o.recorded for o in autoscaler.run()] == [None]
    assert ScalingDecision.objects.count() == 1


def test_no_decision_without_a_sustained_breach_or_with_autoscale_off(catalog):  # type: ignore[no-untyped-def]
    d = make_deployment(catalog)
    replicas = ready_replicas(d, catalog["fra"], 2, catalog["h100"])
    store_rounds(replicas, 2, running=20, waiting=8, kv_usage=0.6)  # two scrapes only
    assert [o.recorded for o in autoscaler.run()] == [None]
    store_rounds(replicas, 8, end=timezone.now() - timedelta(seconds=3), running=20, waiting=8)
    Deployment.objects.filter(pk=d.pk).update(autoscale=False)
    assert autoscaler.run() == []
    assert not ScalingDecision.objects.exists()


def test_kv_pressure_on_the_recorded_samples_drives_the_count(catalog):  # type: ignore[no-untyped-def]
    d = make_deployment(catalog)
    replicas = ready_replicas(d, catalog["fra"], 2, catalog["h100"])
    store_rounds(replicas, 6, running=20, waiting=0, kv_usage=0.97)
    [outcome] = autoscaler.run()
    assert recorded(outcome).replicas_after == 3  # ceil(2 × 0.97 / 0.75)
    assert recorded(outcome).signals["kv_mean"] == pytest.approx(0.97)


def test_ttft_over_the_slo_from_stored_histograms(catalog):  # type: ignore[no-untyped-def]
    d = make_deployment(catalog)
    [replica] = ready_replicas(d, catalog["fra"], 1, catalog["h100"])
    end = timezone.now()
    rows = []
    for i in range(4):  # each scrape adds 20 first tokens, all between 1 and 2.5 s
        buckets = {"ttft": {"0.5": 0.0, "1.0": 0.0, "2.5": 20.0 * i, "+Inf": 20.0 * i}}
        rows.append(ReplicaSample(replica=replica, at=end - timedelta(seconds=6 - 2 * i),
                                  running=10, kv_usage=0.4, buckets=buckets))
    ReplicaSample.objects.bulk_create(rows)
    [outcome] = autoscaler.run()
    assert outcome.recorded is not None and outcome.recorded.direction == "up"
    assert "TTFT p95" in outcome.recorded.reason and "SLO 800 ms" in outcome.recorded.reason
    assert outcome.recorded.signals["ttft_p95_ms"] > 800


def test_no_solver_plan_places_beside_running_replicas(catalog):  # type: ignore[no-untyped-def]
    # Three regions asked for, but only two EU regions exist: the solver has no plan.
    d = make_deployment(catalog, spread_regions=3)
    replicas = ready_replicas(d, catalog["fra"], 2, catalog["h100"])
    store_rounds(replicas, 6, running=20, waiting=8)
    [outcome] = autoscaler.run()
    decision = recorded(outcome)
    assert decision.placed == ["aws:eu-central-1"]
    assert "solver found no plan" in decision.signals["placement"]
    assert "beside running replicas" in decision.signals["placement"]


def test_no_room_anywhere_allowed_places_nothing_and_says_why(catalog):  # type: ignore[no-untyped-def]
    d = make_deployment(catalog)
    replicas = ready_replicas(d, catalog["fra"], 2, catalog["h100"])
    # EU H100 quota is exhausted; the US has plenty but is not allowed.
    Quota.objects.filter(region=catalog["fra"]).update(limit_gpus=2)
    Quota.objects.filter(region=catalog["ams"]).update(limit_gpus=0)
    Offer.objects.filter(gpu_type=catalog["l4"]).delete()
    store_rounds(replicas, 6, running=20, waiting=8)
    [outcome] = autoscaler.run()
    decision = recorded(outcome)
    assert (decision.replicas_before, decision.replicas_after, decision.placed) == (2, 2, [])
    assert "wanted 3, placed 0" in decision.reason and "solver found no plan" in decision.reason
    assert not Replica.objects.filter(deployment=d, state=S.PENDING).exists()
    # The attempt counts for the cooldown: it is not retried every 2 s.
    assert [o.recorded for o in autoscaler.run()] == [None]


def test_idle_replicas_are_drained_idlest_and_dearest_first(  # type: ignore[no-untyped-def]
        catalog, sent_tasks, django_capture_on_commit_callbacks):
    d = make_deployment(catalog, min_replicas=1, scale_down_cooldown_s=60)
    fra = ready_replicas(d, catalog["fra"], 2, catalog["h100"])
    [ams] = ready_replicas(d, catalog["ams"], 1, catalog["h100"])
    end = timezone.now()
    store_rounds(fra[:1], 70, end=end, running=4, kv_usage=0.1)
    store_rounds(fra[1:], 70, end=end, running=0, kv_usage=0.0)
    store_rounds([ams], 70, end=end, running=0, kv_usage=0.0)
    with django_capture_on_commit_callbacks(execute=True):
        [outcome] = autoscaler.run()
    decision = recorded(outcome)
    assert decision.direction == "down" and (decision.replicas_before,
                                             decision.replicas_after) == (3, 2)
    # fra[1] and ams are both idle; fra's offer costs more, so fra[1] drains.
    assert decision.signals["retired"] == [fra[1].public_id]
    fra[1].refresh_from_db()
    assert fra[1].state == S.DRAINING
    assert ("provisioning.terminate_replica", (fra[1].pk, f"autoscaler: {decision.reason}"),
            {"countdown": 30}) in sent_tasks
    assert AuditLog.objects.filter(action="deployment.scale_down").exists()


def test_replicas_a_plan_just_added_are_not_drained_before_the_cooldown(catalog):  # type: ignore[no-untyped-def]
    from controlplane.placement.models import ChangeAction, Plan, PlanChange, PlanStatus

    d = make_deployment(catalog, min_replicas=1, scale_down_cooldown_s=300)
    replicas = ready_replicas(d, catalog["fra"], 3, catalog["h100"])
    store_rounds(replicas, 70, end=timezone.now(), running=0, kv_usage=0.0)
    plan = Plan.objects.create(status=PlanStatus.APPLIED, proposed_by="ops",
                               applied_at=timezone.now() - timedelta(seconds=90))
    PlanChange.objects.create(plan=plan, deployment=d, action=ChangeAction.ADD,
                              region=catalog["fra"], count=2)
    assert [o.recorded for o in autoscaler.run()] == [None]
    Plan.objects.filter(pk=plan.pk).update(applied_at=timezone.now() - timedelta(seconds=301))
    [outcome] = autoscaler.run()
    assert outcome.recorded is not None and outcome.recorded.direction == "down"


def test_spread_is_kept_when_draining(catalog):  # type: ignore[no-untyped-def]
    d = make_deployment(catalog, min_replicas=2, spread_regions=2, scale_down_cooldown_s=60)
    fra = ready_replicas(d, catalog["fra"], 2, catalog["h100"])
    [ams] = ready_replicas(d, catalog["ams"], 1, catalog["h100"])
    end = timezone.now()
    store_rounds(fra, 70, end=end, running=1)
    store_rounds([ams], 70, end=end, running=0)  # idlest, but the only one in its region
    [outcome] = autoscaler.run()
    assert recorded(outcome).signals["retired"] == [fra[1].public_id]


def test_batch_scales_to_zero_and_back_on_edge_demand(catalog, sent_tasks):  # type: ignore[no-untyped-def]
    from controlplane.routing.models import Edge

    d = make_deployment(catalog, name="nightly", tier=Tier.BATCH, min_replicas=0,
                        scale_down_cooldown_s=60)
    [replica] = ready_replicas(d, catalog["fra"], 1, catalog["h100"])
    store_rounds([replica], 70, running=0, waiting=0, kv_usage=0.0)
    [outcome] = autoscaler.run()
    assert (recorded(outcome).direction, recorded(outcome).replicas_after) == ("down", 0)
    replica.refresh_from_db()
    assert replica.state == S.DRAINING

    # Nothing serves it now; the edge answers 404 for its model and counts the requests.
    edge = Edge.objects.create(name="edge-eu", region=catalog["fra"],
                               admin_url="http://127.0.0.1:8199")
    now = timezone.now()
    EdgeSample.objects.bulk_create([
        EdgeSample(edge=edge, at=now - timedelta(seconds=4), requests={"nightly||acme|404": 1}),
        EdgeSample(edge=edge, at=now - timedelta(seconds=2),
                   requests={"nightly||acme|404": 3, "other||acme|404": 9}),
    ])
    [outcome] = autoscaler.run()
    woken = recorded(outcome)
    assert (woken.direction, woken.replicas_before, woken.replicas_after) == ("up", 0, 1)
    assert "scale from zero" in woken.reason and woken.signals["unserved_requests"] == 2
    # The kind it last ran (H100), the cheapest in the EU.
    assert woken.placed == ["gcp:europe-west4"]


def test_an_edge_restart_inside_the_window_keeps_the_unserved_requests(catalog):  # type: ignore[no-untyped-def]
    """An edge that restarted between scrapes (its 404 counter fell from 5 to 1) still
    reports the requests it could not route before the restart: 4 before and 1 after, not
    the 1 that comparing only the window's ends finds."""
    from controlplane.routing.models import Edge

    d = make_deployment(catalog, name="nightly", tier=Tier.BATCH, min_replicas=0)
    edge = Edge.objects.create(name="edge-eu", region=catalog["fra"],
                               admin_url="http://127.0.0.1:8199")
    now = timezone.now()
    EdgeSample.objects.bulk_create([
        EdgeSample(edge=edge, at=now - timedelta(seconds=6), requests={"nightly||acme|404": 1}),
        EdgeSample(edge=edge, at=now - timedelta(seconds=4), requests={"nightly||acme|404": 5}),
        EdgeSample(edge=edge, at=now - timedelta(seconds=2), requests={"nightly||acme|404": 1}),
    ])
    assert autoscaler.unserved_requests([d], now, 10.0) == {d.pk: 5.0}


def test_the_task_runs_the_loop_under_its_lock(catalog):  # type: ignore[no-untyped-def]
    from controlplane.core.locks import advisory_lock
    from controlplane.scaling.tasks import autoscale

    d = make_deployment(catalog)
    replicas = ready_replicas(d, catalog["fra"], 2, catalog["h100"])
    store_rounds(replicas, 6, running=20, waiting=8)
    assert autoscale() == {"deployments": 1, "decisions": 1}
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    with advisory_lock("telemetry.autoscale") as held:
        assert held

        def other_worker() -> dict[str, int]:
            try:
                return autoscale()
            finally:
                connection.close()

        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(other_worker).result() == {"skipped": 1}


def test_a_tick_reads_the_same_few_queries_for_one_deployment_or_many(catalog):  # type: ignore[no-untyped-def]
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def tick_queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            outcomes = autoscaler.run()
        assert all(o.recorded is None for o in outcomes)
        return len(captured)

    first = make_deployment(catalog, name="d0", scale_down_cooldown_s=60)
    store_rounds(ready_replicas(first, catalog["fra"], 2, catalog["h100"]), 70, running=15)
    one = tick_queries()
    for i in range(1, 8):
        d = make_deployment(catalog, name=f"d{i}", scale_down_cooldown_s=60)
        store_rounds(ready_replicas(d, catalog["fra"], 2, catalog["h100"]), 70, running=15)
    assert tick_queries() == one <= 8


def test_the_idle_window_before_a_scale_down_comes_from_settings(catalog, settings):  # type: ignore[no-untyped-def]
    d = make_deployment(catalog, name="nightly", tier=Tier.BATCH, min_replicas=0,
                        scale_down_cooldown_s=0)
    [replica] = ready_replicas(d, catalog["fra"], 1, catalog["h100"])
    store_rounds([replica], 10, running=0, waiting=0, kv_usage=0.0)
    [held] = autoscaler.run()
    assert held.decision.direction is None   # idle 10 s of the default 60
    settings.SCALE_DOWN_WINDOW_S = 8.0
    [outcome] = autoscaler.run()
    assert (recorded(outcome).direction, recorded(outcome).replicas_after) == ("down", 0)
    assert "batch tier scales to zero" in recorded(outcome).reason

"""A fleet of any size for dashboard tests: regions with offers and quota, three deployments
with replicas in every state, edges with two tables each, events, keys, a plan and engine
samples — the same shape at every size, so small and large fleets exercise the same code."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.utils import timezone

from controlplane.core.models import AuditLog
from controlplane.core.services import issue_api_key
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement.basis import record
from controlplane.placement.models import ChangeAction, Plan, PlanChange
from controlplane.routing.models import Edge, RoutingTable
from controlplane.telemetry.models import ReplicaSample
from regions.models import Cloud, Offer, Quota, Region

# Serving states come first so that even a tiny fleet has ready replicas in each deployment.
STATE_CYCLE = (S.READY, S.READY, S.READY, S.STARTING, S.DEGRADED, S.FAILED, S.DRAINING,
               S.PENDING, S.TERMINATED, S.PROVISIONING, S.READY, S.READY)
BUCKET_BOUNDS = ("0.05", "0.1", "0.25", "0.5", "1.0", "+Inf")


@dataclass
class Fleet:
    deployments: list[Deployment]
    edges: list[Edge]
    plan: Plan
    replicas: list[Replica]

    @property
    def acme(self) -> Deployment:
        return self.deployments[0]

    @property
    def shared(self) -> Deployment:
        return self.deployments[1]

    @property
    def globex(self) -> Deployment:
        return self.deployments[2]


def _extra_regions(catalog: dict[str, Any], count: int) -> None:
    if count <= 0:
        return
    cloud, _ = Cloud.objects.get_or_create(name="testcloud",
                                           defaults={"display_name": "Test Cloud"})
    start = cloud.regions.count()
    now = timezone.now()
    made = Region.objects.bulk_create([
        Region(cloud=cloud, code=f"zone-{i:03d}", display_name=f"Zone {i}",
               latitude=-50 + (i * 37) % 120, longitude=-170 + (i * 53) % 340,
               country="DE" if i % 2 else "US",
               jurisdiction=catalog["eu"] if i % 2 else catalog["us"])
        for i in range(start, start + count)
    ])
    Offer.objects.bulk_create([
        Offer(region=region, gpu_type=catalog["h100"], gpus_per_node=1, instance_type="h100x1",
              on_demand_usd_h=Decimal("2.00") + Decimal(i % 7) / 2,
              spot_usd_h=Decimal("1.00") if i % 3 else None,
              # Half the regions' prices, in either jurisdiction, are a month old: stale.
              observed_at=now - timedelta(days=30 if i % 4 in (1, 2) else 0))
        for i, region in enumerate(made)
    ])
    Quota.objects.bulk_create([
        Quota(region=region, gpu_type=catalog["h100"], limit_gpus=8, in_use_gpus=i % 9,
              observed_at=now)
        for i, region in enumerate(made)
    ])


def _deployment(catalog: dict[str, Any], name: str, tenant: Any, jurisdictions: list[Any],
                max_replicas: int) -> Deployment:
    deployment = Deployment.objects.create(
        name=name, served_model_name=f"{name}-model", model=catalog["llama8b"], tenant=tenant,
        min_replicas=0, max_replicas=max_replicas, slo_ttft_p95_ms=800, slo_itl_p95_ms=60,
    )
    deployment.allowed_jurisdictions.set(jurisdictions)
    return deployment


def _table(edge: Edge, version: int, replicas: list[Replica], tenants: dict[str, Any],
           weight: float) -> dict[str, Any]:
    return {
        "version": version, "issued_at": timezone.now().isoformat(), "edge": edge.name,
        "key_id": "test-key",
        "models": {"llama": {"replicas": [
            {"id": r.public_id, "url": r.url, "region": r.region.key,
             "jurisdiction": r.region.jurisdiction.code, "weight": weight if i == 0 else 1.0,
             "rtt_ms": 10.0 + i, "state": r.state, "max_inflight": 64, "tier": "interactive"}
            for i, r in enumerate(replicas)
        ]}},
        "tenants": tenants,
        "aliases": {},
        "policy": {"scorers": {"latency": 1.0, "load": 2.0, "prefix": 3.0, "cost": 0.5},
                   "retry_before_first_byte": 2, "eject_after_failures": 2,
                   "eject_base_s": 1.0 if version % 2 else 2.0},
        "signature": f"sig-{version}",
    }


def _samples(replicas: list[Replica]) -> None:
    now = timezone.now()
    rows = []
    for replica in replicas:
        for step, seconds_ago in enumerate((90, 45, 5)):
            served = 100.0 * (step + 1)
            rows.append(ReplicaSample(
                replica=replica, at=now - timedelta(seconds=seconds_ago), up=True,
                running=2 + step, waiting=step, kv_usage=0.2 * (step + 1),
                counters={"requests_ok": served, "generation_tokens": 50 * served},
                buckets={"ttft": {le: served * (k + 1) / len(BUCKET_BOUNDS)
                                  for k, le in enumerate(BUCKET_BOUNDS)},
                         "itl": {le: 10 * served for le in BUCKET_BOUNDS}},
            ))
    ReplicaSample.objects.bulk_create(rows)


def _add_replicas(catalog: dict[str, Any], deployments: list[Deployment], count: int,
                  start: int = 0) -> list[Replica]:
    all_regions = list(Region.objects.select_related("cloud", "jurisdiction").order_by("pk"))
    offers = {o.region_id: o for o in Offer.objects.filter(gpu_type=catalog["h100"])}
    eu_regions = [r for r in all_regions if r.jurisdiction_id == catalog["eu"].pk]
    rows = []
    for i in range(start, start + count):
        deployment = deployments[i % 3]
        allowed = eu_regions if deployment is deployments[0] else all_regions
        region = allowed[(i // 3) % len(allowed)]
        state = STATE_CYCLE[(i // 3) % len(STATE_CYCLE)]
        rows.append(Replica(
            deployment=deployment, region=region, offer=offers.get(region.pk), state=state,
            spot=i % 4 == 0, provider="local",
            url=(f"http://127.0.0.1:{20000 + i}"
                 if state in (S.READY, S.DEGRADED, S.DRAINING) else ""),
            last_error="engine exited with code 1" if state == S.FAILED else "",
        ))
    made = Replica.objects.bulk_create(rows)
    made = list(Replica.objects.filter(pk__in=[r.pk for r in made])
                .select_related("region__cloud", "region__jurisdiction", "deployment"))
    AuditLog.objects.bulk_create([
        AuditLog(actor="system:provisioning", action=f"replica.{r.state}",
                 object_type="deployments.replica", object_id=str(r.pk), object_repr=str(r),
                 tenant_id=r.deployment.tenant_id, changes={"to": r.state},
                 reason="seeded for the dashboard tests")
        for r in made
    ])
    return made


def _add_edges(count: int, serving: list[Replica], start: int = 0) -> list[Edge]:
    all_regions = list(Region.objects.select_related("cloud").order_by("pk"))
    tenant_rules = {"a" * 64: {"tenant": "acme", "jurisdictions": ["EU"], "regions": [],
                               "rpm": 600, "tpm": 200000, "models": ["*"], "tier": "interactive"}}
    edges = []
    for j in range(start, start + count):
        edge = Edge.objects.create(name=f"edge-{j}", region=all_regions[j % len(all_regions)],
                                   admin_url=f"http://127.0.0.1:{19000 + j}",
                                   last_error="connection refused" if j == 0 else "")
        older, newer = 2 * j + 1, 2 * j + 2
        RoutingTable.objects.bulk_create([
            RoutingTable(edge=edge, version=older,
                         payload=_table(edge, older, serving[:-1], {}, 1.0),
                         payload_hash=f"h{older}", content_hash=f"c{older}"),
            RoutingTable(edge=edge, version=newer,
                         payload=_table(edge, newer, serving, tenant_rules, 0.0),
                         payload_hash=f"h{newer}", content_hash=f"c{newer}"),
        ])
        # The first edge is behind (acked the older table); the others are in sync.
        edge.last_acked_version = older if j == 0 else newer
        edge.last_acked_at = edge.last_seen_at = timezone.now()
        edge.save()
        edges.append(edge)
    return edges


def seed_fleet(catalog: dict[str, Any], tenants: dict[str, Any], *, regions: int,
               replicas: int, edges: int) -> Fleet:
    _extra_regions(catalog, regions - 3)
    # A fleet far larger than the default per-tenant caps: the caps are raised as platform
    # staff would for such tenants, so that the pages, not the caps, are what is exercised.
    for tenant in (tenants["acme"], tenants["globex"]):
        tenant.max_replicas, tenant.max_gpus = 5000, 40000
        tenant.save(update_fields=["max_replicas", "max_gpus"])
    offers = {o.region_id: o for o in Offer.objects.filter(gpu_type=catalog["h100"])}
    eu, us = catalog["eu"], catalog["us"]
    # max_replicas leaves room for grow_fleet's 1,000.
    deployments = [
        _deployment(catalog, "chat-acme", tenants["acme"], [eu], 2000),
        _deployment(catalog, "chat-shared", None, [eu, us], 2000),
        _deployment(catalog, "batch-globex", tenants["globex"], [eu, us], 2000),
    ]
    made = _add_replicas(catalog, deployments, replicas)
    serving = [r for r in made if r.state == S.READY]
    issue_api_key(tenants["acme"], "web", "interactive")
    issue_api_key(tenants["globex"], "batch", "batch")
    edge_rows = _add_edges(edges, serving)
    plan = Plan.objects.create(
        trigger="manual", proposed_by="operator-platform", explanation="cheaper EU capacity",
        cost_before_usd_h=Decimal("24.58"), cost_after_usd_h=Decimal("23.00"),
        solver={"status": "optimal", "solve_s": 0.02},
    )
    PlanChange.objects.bulk_create([
        PlanChange(plan=plan, deployment=deployments[0], action=ChangeAction.ADD,
                   region=catalog["ams"], offer=offers[catalog["ams"].pk], count=1,
                   usd_h_delta=Decimal("11.50"), reason="EU, cheapest H100 with quota left"),
        PlanChange(plan=plan, deployment=deployments[0], action=ChangeAction.REMOVE,
                   region=catalog["fra"], offer=offers[catalog["fra"].pk], count=1,
                   usd_h_delta=Decimal("-12.29"), reason="more expensive than europe-west4"),
    ])
    record(plan)  # computed from the fleet as seeded
    _samples([r for r in serving if r.deployment_id == deployments[0].pk][:3])
    return Fleet(deployments=deployments, edges=edge_rows, plan=plan, replicas=made)


def grow_fleet(fleet: Fleet, catalog: dict[str, Any], *, regions: int, replicas: int,
               edges: int) -> None:
    """Add regions, replicas (with their events and samples) and edges to a seeded fleet."""
    _extra_regions(catalog, regions)
    made = _add_replicas(catalog, fleet.deployments, replicas, start=len(fleet.replicas))
    serving = [r for r in made if r.state == S.READY]
    fleet.edges += _add_edges(edges, serving, start=len(fleet.edges))
    _samples(serving)
    fleet.replicas += made

"""Property: lines sent straight to replicas go only where an edge would send the tenant's
requests. Whatever jurisdictions and regions the tenant may use, and whichever shared or
dedicated deployments run where, the replicas a batch may use are exactly those the
tenant's key may use in the routing table the control plane compiles for the edges, as the
edge parses that table and applies its residency rule."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.batches.models import Batch
from controlplane.batches.transport import eligible_replicas
from controlplane.core.models import Tenant
from controlplane.core.services import issue_api_key
from controlplane.deployments.models import Deployment, Replica, ReplicaState
from controlplane.routing import compiler
from controlplane.routing import services as routing
from edge.table import parse_table

pytestmark = pytest.mark.django_db

MODEL = "llama-3.1-8b"
REGIONS = ("fra", "iad", "ams")
DEPLOYMENTS = st.lists(st.tuples(st.sampled_from([None, "acme", "globex"]),
                                 st.sets(st.sampled_from(REGIONS), min_size=1)),
                       min_size=1, max_size=4)


def edge_choice(tenant: Tenant, key_hash: str) -> set[str]:
    """The URLs of the model's ready replicas the tenant's key may use at an edge."""
    table = parse_table(compiler.compile_table(
        compiler.EdgeView("edge-fra", "aws:eu-central-1", 50.1, 8.7), routing.replica_views(),
        routing.key_views(), routing.policy_view(routing.current_policy()),
        version=1, issued_at="2026-11-01T00:00:00+00:00", key_id="test"))
    rules = table.tenants[key_hash]
    assert rules.tenant == tenant.name
    return {r.url for r in table.models.get(MODEL, ()) if r.state == ReplicaState.READY
            and rules.may_use_replica(r)}


def test_a_batch_uses_the_replicas_an_edge_would(catalog: Any, tenants: Any,
                                                 signing_key_file: Any) -> None:
    acme = tenants["acme"]
    key, _ = issue_api_key(acme, "acme", "batch")
    ports = itertools.count(20000)

    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(st.sets(st.sampled_from(["eu", "us"])), st.sets(st.sampled_from(REGIONS)),
           DEPLOYMENTS)
    def example(jurisdictions: set[str], regions: set[str],
                deployments: list[tuple[str | None, set[str]]]) -> None:
        with transaction.atomic():
            acme.allowed_jurisdictions.set([catalog[j] for j in jurisdictions])
            acme.allowed_regions.set([catalog[r] for r in regions])
            for n, (owner, where) in enumerate(deployments):
                deployment = Deployment.objects.create(
                    name=f"d{n}", served_model_name=MODEL, model=catalog["llama8b"],
                    tenant=tenants[owner] if owner else None)
                for region in sorted(where):
                    Replica.objects.create(deployment=deployment, region=catalog[region],
                                           url=f"http://127.0.0.1:{next(ports)}",
                                           state=ReplicaState.READY)
            batch = Batch(tenant=acme, model=MODEL)
            chosen = {r.url for r in eligible_replicas(batch)}
            assert chosen == edge_choice(acme, key.key_hash)
            transaction.set_rollback(True)

    example()

"""A fleet with two tenants and platform data for the security tests: acme attacks, globex's
rows and the platform's secrets are what must never show or change.

Every tenant-owned model gets a row of acme's, of globex's and a shared one
(tests/tenant_rows.py). Globex's deployments are named `globex-…` and globex's tenant name is
in every row that carries it, so a leak of its rows shows as the word "globex". Replicas have
engine addresses (10.77.…), the edge an admin address and an error (10.66.…), an operation
a traceback: none of it is for tenant users.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Q
from django.forms.models import model_to_dict

from controlplane.api.urls import router
from controlplane.core.models import Tenant
from controlplane.core.tenancy import has_tenancy, tenancy_of, tenant_owned_models
from tests.tenant_rows import BUILDERS, NOW

# Words that must never reach a tenant user of acme: the other tenant, engine and edge
# addresses, and tracebacks.
SECRETS = ("globex", "10.77.", "10.66.", "Traceback")


def build_world(fx: dict[str, Any]) -> dict[str, Any]:
    from controlplane.deployments.models import Deployment, Replica
    from controlplane.failover.models import Incident
    from controlplane.placement.models import Plan, PlanChange
    from controlplane.provisioning.models import Operation
    from controlplane.routing.models import Edge
    from controlplane.routing.services import current_policy

    acme, globex = fx["acme"], fx["globex"]
    rows: dict[str, tuple[Any, Any, Any]] = {
        label: (build(fx, acme), build(fx, globex), build(fx, None))
        for label, build in BUILDERS.items()}
    for d in Deployment.objects.filter(tenant=globex):
        Deployment.objects.filter(pk=d.pk).update(name=f"globex-{d.pk}")
    for r in Replica.objects.all():
        Replica.objects.filter(pk=r.pk).update(url=f"http://10.77.0.{r.pk % 250}:8000",
                                               last_error=f"connect to 10.77.0.{r.pk % 250} refused")
    globex_deployment = Deployment.objects.filter(tenant=globex).order_by("pk")[0]
    globex_replica = Replica.objects.filter(deployment__tenant=globex).order_by("pk")[0]
    plan = Plan.objects.create(proposed_by="system", explanation="globex grows")
    PlanChange.objects.create(plan=plan, deployment=globex_deployment, action="add",
                              region=fx["fra"], count=1, reason="globex demand")
    Incident.objects.create(kind="drill", region=fx["fra"], summary="globex replicas killed",
                            started_at=NOW, failed_replicas=[globex_replica.public_id])
    Edge.objects.create(name="edge-eu", region=fx["fra"], admin_url="http://10.66.0.1:8110",
                        public_url="https://edge.example.org", last_error="push to 10.66.0.1 failed")
    shared_replica = Replica.objects.filter(deployment__tenant__isnull=True).first()
    Operation.objects.create(kind="launch", provider="local", replica=shared_replica,
                             status="failed", error_kind="capacity",
                             log="Traceback (most recent call last):\n  File \"x.py\"\n"
                                 "ConnectionError: http://10.77.0.9:8000 refused\n")
    current_policy()
    return {**fx, "rows": rows, "globex_deployment": globex_deployment,
            "globex_replica": globex_replica}


def platform_models() -> list[type[models.Model]]:
    """Models the API serves that belong to no tenant (catalog, plans, edges, policy …)."""
    owned = set(tenant_owned_models())
    querysets = [getattr(viewset, "queryset", None) for _, viewset, _ in router.registry]
    served = {qs.model for qs in querysets if qs is not None}
    return sorted(served - owned, key=lambda m: m._meta.label)


def not_acme(model: type[models.Model], acme: Tenant) -> Q:
    """Rows of `model` that are not acme's own: globex's, shared and platform rows."""
    if not has_tenancy(model):
        return Q()
    tenancy = tenancy_of(model)
    mine = Q(**{tenancy.path: acme.name if tenancy.by_name else acme.pk})
    return ~mine


def snapshot(acme: Tenant) -> dict[str, list[dict[str, Any]]]:
    """Every row acme does not own, field by field: what no request of acme's may change."""
    seen: dict[str, list[dict[str, Any]]] = {}
    for model in [*tenant_owned_models(), *platform_models()]:
        rows = model._default_manager.filter(not_acme(model, acme)).order_by("pk")
        seen[model._meta.label] = [model_to_dict(row) for row in rows]
    return seen

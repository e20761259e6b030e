"""The one tenancy rule (`visible_to`), run over every model whose rows belong to tenants,
as the app registry lists them: a model added later is checked without being named here."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import models

from controlplane.core.models import Role, Tenant
from controlplane.core.services import Principal
from controlplane.core.tenancy import (
    TenantQuerySet,
    owner_tenant_id,
    tenancy_of,
    tenant_owned_models,
)
from tests.tenant_rows import BUILDERS

MODELS = tenant_owned_models()


def _label(model: type[models.Model]) -> str:
    return model._meta.label


def _viewer(tenant: Tenant | None, role: str | None = Role.VIEWER) -> Principal:
    return Principal("someone", role, tenant.pk if tenant else None)


def test_discovery_finds_the_models_reached_through_relations() -> None:
    labels = {_label(m) for m in MODELS}
    assert {"core.Tenant", "deployments.Deployment", "deployments.Replica",
            "provisioning.Operation", "telemetry.GpuReading", "costs.CostRollup",
            "alerts.AlertDelivery"} <= labels
    assert not labels & {"regions.Region", "placement.Plan", "routing.Edge"}


@pytest.mark.parametrize("model", MODELS, ids=_label)
def test_model_declares_how_rows_reach_their_tenant(model: type[models.Model]) -> None:
    assert _label(model) in BUILDERS, f"add a builder for {_label(model)} to tests/tenant_rows.py"
    tenancy = tenancy_of(model)
    assert isinstance(model._default_manager.all(), TenantQuerySet)
    *steps, last = tenancy.path.split("__")
    meta = model._meta
    for step in steps:
        related = meta.get_field(step).related_model
        assert related is not None, f"{_label(model)}: {step} is not a relation"
        meta = related._meta  # type: ignore[union-attr]
    field = meta.get_field(last)
    if tenancy.by_name:
        assert isinstance(field, models.CharField)
    elif model is Tenant:
        assert last == "id"
    else:
        assert field.related_model is Tenant, f"{tenancy.path} does not end at the tenant"


@pytest.mark.django_db
@pytest.mark.parametrize("model", MODELS, ids=_label)
def test_tenant_user_sees_own_and_shared_rows_only(model: type[models.Model], catalog: Any,
                                                   tenants: Any) -> None:
    acme, globex = tenants["acme"], tenants["globex"]
    build = BUILDERS[_label(model)]
    own, others = build(catalog, acme), build(catalog, globex)
    unowned = build(catalog, None)
    rows: Any = model._default_manager.all()
    tenancy = tenancy_of(model)

    def seen(principal: Principal) -> set[Any]:
        return set(rows.visible_to(principal).values_list("pk", flat=True))

    assert own is not None and others is not None
    acme_sees = seen(_viewer(acme))
    assert own.pk in acme_sees
    assert others.pk not in acme_sees
    assert others.pk in seen(_viewer(globex, Role.ADMIN))
    if unowned is not None:
        assert (unowned.pk in acme_sees) == tenancy.shared
        assert unowned.pk in seen(_viewer(None))
    assert {own.pk, others.pk} <= seen(_viewer(None))
    assert seen(_viewer(None, role=None)) == set()
    assert seen(_viewer(acme, role=None)) == set()
    assert owner_tenant_id(own) == (acme.name if tenancy.by_name else acme.pk)

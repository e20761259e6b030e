"""Tenants and their inference API keys: limits, residency, members; create and revoke keys.

As in the API, tenant users see their own tenant only, and admins (platform staff, or a
tenant's own admins for that tenant) create and revoke keys. A new key is shown once.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.db import transaction
from django.db.models import Count, F, Prefetch, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect

from controlplane.core.models import ApiKey, Membership, Role, Tenant
from controlplane.core.services import Principal, issue_api_key, record_audit, set_key_revoked
from frontend.access import change_refusal, principal_of
from frontend.forms import ApiKeyForm, ReasonForm
from frontend.views.common import (
    dashboard_view,
    forbidden,
    paginate,
    query_without_page,
    render_page,
)
from regions.models import Region


def visible_tenants(principal: Principal) -> Any:
    return Tenant.objects.visible_to(principal)


@dashboard_view()
def tenant_list(request: HttpRequest) -> HttpResponse:
    rows = visible_tenants(principal_of(request)).prefetch_related(
        "allowed_jurisdictions", Prefetch("allowed_regions", Region.objects.select_related("cloud"))
    ).annotate(
        active_keys=Count("api_keys", filter=Q(api_keys__revoked_at__isnull=True), distinct=True),
        deployment_count=Count("deployments", distinct=True),
    ).order_by("name")
    return render_page(request, "frontend/tenants/list.html", {
        "page": paginate(request, rows), "query": query_without_page(request),
    })


def _tenant(request: HttpRequest, name: str) -> Tenant:
    rows = visible_tenants(principal_of(request)).prefetch_related(
        "allowed_jurisdictions",
        Prefetch("allowed_regions", Region.objects.select_related("cloud")),
    )
    return get_object_or_404(rows, name=name)


def _detail(request: HttpRequest, tenant: Tenant, form: ApiKeyForm | None = None,
            new_key: str | None = None, new_row: ApiKey | None = None,
            status: int = 200) -> HttpResponse:
    principal = principal_of(request)
    keys = tenant.api_keys.order_by(F("revoked_at").desc(nulls_first=True), "name")
    response = render_page(request, "frontend/tenants/detail.html", {
        "tenant": tenant,
        "keys": paginate(request, keys),
        "query": query_without_page(request),
        "members": Membership.objects.filter(tenant=tenant).select_related("user")
        .order_by("user__username"),
        "deployments": tenant.deployments.order_by("name").values("name", "served_model_name"),
        "form": form or ApiKeyForm(),
        "may_manage_keys": principal.has_role(Role.ADMIN)
        and change_refusal(principal, tenant.pk) is None,
        "new_key": new_key,
        "new_row": new_row,
    }, section="tenants", status=status)
    if new_key:
        # The one response that carries the key must not be kept by any cache.
        response["Cache-Control"] = "no-store"
    return response


@dashboard_view()
def tenant_detail(request: HttpRequest, name: str) -> HttpResponse:
    return _detail(request, _tenant(request, name))


@dashboard_view(role=Role.ADMIN, methods=("POST",))
def create_key(request: HttpRequest, name: str) -> HttpResponse:
    principal = principal_of(request)
    tenant = _tenant(request, name)
    refusal = change_refusal(principal, tenant.pk)
    if refusal:
        return forbidden(request, refusal)
    form = ApiKeyForm(request.POST)
    if form.is_valid() and tenant.api_keys.filter(name=form.cleaned_data["name"]).exists():
        form.add_error("name", f"{tenant.name} already has a key named "
                               f"{form.cleaned_data['name']!r}; keys keep their names "
                               "after revocation.")
    if not form.is_valid():
        return _detail(request, tenant, form=form, status=400)
    with transaction.atomic():
        row, key = issue_api_key(tenant, form.cleaned_data["name"], form.cleaned_data["tier"],
                                 form.cleaned_data["allowed_models"])
        record_audit(principal.username, "create", row, reason="dashboard", changes={
            "tenant": tenant.name, "name": row.name, "tier": row.tier,
            "allowed_models": row.allowed_models,
        })
    return _detail(request, tenant, new_key=key, new_row=row)


@dashboard_view(role=Role.ADMIN, methods=("POST",))
def revoke_key(request: HttpRequest, pk: int) -> HttpResponse:
    principal = principal_of(request)
    rows = ApiKey.objects.select_related("tenant").visible_to(principal)
    key = get_object_or_404(rows, pk=pk)
    refusal = change_refusal(principal, key.tenant_id)
    if refusal:
        return forbidden(request, refusal)
    form = ReasonForm(request.POST)
    reason = (form.cleaned_data["reason"] if form.is_valid() else "") or "dashboard"
    with transaction.atomic():
        # Locked, so that two revocations cannot both record themselves; the save pushes
        # the tables. Who revoked is kept: a platform revocation is final for tenant admins.
        locked = ApiKey.objects.select_for_update().get(pk=key.pk)
        revoked = set_key_revoked(locked, True, principal)
        if revoked:
            record_audit(principal.username, "revoke", key, reason=reason)
    if revoked:
        messages.success(request, f"Key {key.name} ({key.prefix}…) revoked: edges refuse it "
                                  "once their next table arrives.")
    else:
        messages.info(request, f"Key {key.name} was already revoked.")
    return redirect("frontend:tenant", name=key.tenant.name)

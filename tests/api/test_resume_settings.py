"""Stream resumption is set through the API: the routing policy's limits and each tenant's
switch reach the edges' tables; values out of range are refused naming the field."""

from __future__ import annotations

from controlplane.core.models import Role, Tenant
from controlplane.routing.models import RoutingPolicy


def test_an_admin_sets_resumption_limits_and_a_tenants_switch(make_client, tenants) -> None:  # type: ignore[no-untyped-def]
    admin = make_client(Role.ADMIN)
    policy = RoutingPolicy.objects.get_or_create(name="default")[0]
    response = admin.patch(f"/api/v1/routing-policy/{policy.pk}/", {
        "resume_streams_max": 3, "resume_deadline_s": 20, "stream_stall_s": 5}, format="json")
    assert response.status_code == 200, response.json()
    assert (response.json()["resume_streams_max"], response.json()["stream_stall_s"]) == (3, 5)
    response = admin.patch(f"/api/v1/tenants/{tenants['acme'].pk}/",
                           {"resume_streams": False}, format="json")
    assert response.status_code == 200 and response.json()["resume_streams"] is False
    assert Tenant.objects.get(pk=tenants["acme"].pk).resume_streams is False


def test_resumption_values_out_of_range_are_refused_naming_the_field(make_client, tenants) -> None:  # type: ignore[no-untyped-def]
    admin = make_client(Role.ADMIN)
    policy = RoutingPolicy.objects.get_or_create(name="default")[0]
    for field, value in (("resume_streams_max", 11), ("resume_streams_max", -1),
                         ("stream_stall_s", 0), ("resume_deadline_s", "soon")):
        response = admin.patch(f"/api/v1/routing-policy/{policy.pk}/", {field: value},
                               format="json")
        assert response.status_code == 400 and field in str(response.json()), (field, value)
    policy.refresh_from_db()
    assert (policy.resume_streams_max, policy.stream_stall_s) == (2, 10.0)  # unchanged
    response = admin.patch(f"/api/v1/tenants/{tenants['acme'].pk}/",
                           {"resume_streams": "perhaps"}, format="json")
    assert response.status_code == 400 and "resume_streams" in str(response.json())
    assert Tenant.objects.get(pk=tenants["acme"].pk).resume_streams is True


def test_an_operator_cannot_change_resumption(make_client, tenants) -> None:  # type: ignore[no-untyped-def]
    policy = RoutingPolicy.objects.get_or_create(name="default")[0]
    response = make_client(Role.OPERATOR).patch(f"/api/v1/routing-policy/{policy.pk}/",
                                              {"resume_streams_max": 0}, format="json")
    assert response.status_code == 403

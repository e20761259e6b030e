"""The edges' first-byte limit is set through the routing policy and compiled into every
table; a value outside 1–600 s is refused naming the field, and nothing changes."""

from __future__ import annotations

from controlplane.core.models import Role
from controlplane.routing import services
from controlplane.routing.compiler import EdgeView, compile_table
from controlplane.routing.models import RoutingPolicy


def test_an_admin_sets_the_first_byte_timeout_and_tables_carry_it(make_client, tenants) -> None:  # type: ignore[no-untyped-def]
    policy = RoutingPolicy.objects.get_or_create(name="default")[0]
    assert policy.first_byte_timeout_s == 30.0
    response = make_client(Role.ADMIN).patch(f"/api/v1/routing-policy/{policy.pk}/",
                                             {"first_byte_timeout_s": 45}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["first_byte_timeout_s"] == 45
    view = services.policy_view(services.current_policy())
    edge = EdgeView("edge-eu", "aws:eu-central-1", 50.1, 8.7)
    table = compile_table(edge, [], [], view, version=1, issued_at="t", key_id="k")
    assert table["policy"]["first_byte_timeout_s"] == 45.0


def test_a_first_byte_timeout_out_of_range_is_refused_naming_the_field(make_client, tenants) -> None:  # type: ignore[no-untyped-def]
    admin = make_client(Role.ADMIN)
    policy = RoutingPolicy.objects.get_or_create(name="default")[0]
    for value in (0.5, 0, -1, 601, "soon", None):
        response = admin.patch(f"/api/v1/routing-policy/{policy.pk}/",
                               {"first_byte_timeout_s": value}, format="json")
        assert response.status_code == 400, (value, response.json())
        assert "first_byte_timeout_s" in response.json(), (value, response.json())
    policy.refresh_from_db()
    assert policy.first_byte_timeout_s == 30.0


def test_a_body_with_a_non_finite_number_is_refused_and_nothing_changes(make_client, tenants) -> None:  # type: ignore[no-untyped-def]
    # JSON has no NaN or Infinity; Python's parser takes them unless told not to, and a policy
    # holding one could not be signed into a table.
    admin = make_client(Role.ADMIN)
    policy = RoutingPolicy.objects.get_or_create(name="default")[0]
    for raw in ('{"first_byte_timeout_s": Infinity}', '{"aliases": {"a": {"x": NaN}}}',
                '{"scorers": {"latency": -Infinity}}'):
        response = admin.patch(f"/api/v1/routing-policy/{policy.pk}/", raw,
                               content_type="application/json")
        assert response.status_code == 400, (raw, response.content)
        assert "JSON" in response.json()["detail"], response.json()
    policy.refresh_from_db()
    assert (policy.first_byte_timeout_s, policy.aliases) == (30.0, {})

"""Every endpoint of the REST API × every tenant role × another tenant's object.

The routes come from the URL router itself (`controlplane.api.urls.urlpatterns`), so a new
endpoint is in the matrix without being named here. For each route, each of its methods is
called by acme's viewer, operator and admin, aimed at globex's row of the model the route
serves (for platform models: the platform's row), with a body that names globex's tenant,
deployment and replica wherever a field could take them. Whatever the answer:

- a route to another tenant's row answers 404 or 403, never 2xx;
- no answer carries globex's data, a replica's or edge's address, or a traceback;
- no row acme does not own (globex's, shared or the platform's) changes.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.urls import URLPattern

from controlplane.api.urls import urlpatterns
from controlplane.core.models import Role
from controlplane.core.tenancy import has_tenancy, tenant_owned_models
from tests.security.world import SECRETS, build_world, snapshot

pytestmark = pytest.mark.django_db

ROLES = (Role.VIEWER, Role.OPERATOR, Role.ADMIN)
METHODS = ("get", "post", "put", "patch", "delete")
OWNED = set(tenant_owned_models())
# Routes whose views serve no queryset: the model their detail lookup names.
LOOKUP_MODELS = {"budgets": "core.Tenant", "edges": "routing.Edge"}


def _routes() -> list[URLPattern]:
    found = []
    for pattern in urlpatterns:
        route = str(pattern.pattern)
        if not isinstance(pattern, URLPattern) or "format" in pattern.pattern.regex.groupindex \
                or not route.strip("^$"):
            continue  # the ".json" twin of a route, and the browsable root
        found.append(pattern)
    return found


ROUTES = _routes()


def _methods(pattern: URLPattern) -> list[str]:
    actions = getattr(pattern.callback, "actions", None)
    if actions:
        return sorted(actions)
    view = pattern.callback.cls  # type: ignore[attr-defined]
    return [m for m in METHODS if hasattr(view, m)]


def _model_of(pattern: URLPattern) -> Any:
    from django.apps import apps

    view = pattern.callback.cls  # type: ignore[attr-defined]
    queryset = getattr(view, "queryset", None)
    if queryset is not None:
        return queryset.model
    prefix = str(pattern.pattern).strip("^").split("/")[0]
    if prefix in LOOKUP_MODELS:
        return apps.get_model(LOOKUP_MODELS[prefix])
    return None


def _target(world: dict[str, Any], model: Any) -> Any:
    """Globex's row of a tenant-owned model; else the platform's newest row (the world's
    plan, incident and edge, which name globex or hold addresses)."""
    if model in OWNED:
        return world["rows"][model._meta.label][1]
    return model._default_manager.order_by("-pk").first()


def _url(pattern: URLPattern, world: dict[str, Any]) -> tuple[str, Any, str]:
    """The route made concrete for globex's (or the platform's) row, that row, and the value
    put in the path (an answer may echo it: that is no leak)."""
    names = list(pattern.pattern.regex.groupindex)
    row, value = None, ""
    kwargs: dict[str, str] = {}
    if names:
        model = _model_of(pattern)
        assert model is not None, f"{pattern.pattern}: add its model to LOOKUP_MODELS"
        row = _target(world, model)
        assert row is not None, f"{pattern.pattern}: no {model._meta.label} row to aim at"
        view = pattern.callback.cls  # type: ignore[attr-defined]
        field = getattr(view, "lookup_field", "pk") if names[0] != "name" else "name"
        value = str(getattr(row, field if field != "pk" else "pk"))
        kwargs = {names[0]: value}
    route = str(pattern.pattern).strip("^$")
    path = re.sub(r"\(\?P<(\w+)>[^)]*\)", lambda m: kwargs[m.group(1)], route)
    path = re.sub(r"<(?:\w+:)?(\w+)>", lambda m: kwargs[m.group(1)], path)
    return f"/api/v1/{path}", row, value


def _attack(world: dict[str, Any]) -> dict[str, Any]:
    """A body naming globex's things in every field that takes a tenant, deployment or
    replica, and asking for more than anyone may."""
    deployment, replica = world["globex_deployment"], world["globex_replica"]
    return {"tenant": "globex", "deployment": deployment.pk, "deployments": [deployment.pk],
            "replica": replica.public_id, "region": "aws:eu-central-1", "revoked": False,
            "name": "attack", "min_replicas": 500, "max_replicas": 500, "reason": "attack",
            "max_gpus": 100000, "to_revision": {"engine_args": {}}, "replicas": 500}


def _leaks(body: bytes, echoed: str) -> list[str]:
    text = body.decode(errors="replace")
    if echoed:
        text = text.replace(echoed, "")
    return [word for word in SECRETS if word.lower() in text.lower()]


@pytest.fixture
def world(catalog, tenants):  # type: ignore[no-untyped-def]
    return build_world({**catalog, **tenants})


def test_the_matrix_covers_every_route_of_the_router() -> None:
    prefixes = {str(p.pattern).strip("^").split("/")[0].split("\\.")[0] for p in ROUTES}
    from controlplane.api.urls import router

    assert {prefix for prefix, _, _ in router.registry} <= prefixes
    assert {"status", "costs", "alert-rules", "gpu-reports", "edges"} <= prefixes
    assert len(ROUTES) >= 50


@pytest.mark.parametrize("pattern", ROUTES, ids=lambda p: str(p.pattern).strip("^$"))
def test_tenant_roles_cannot_read_or_change_what_is_not_theirs(  # type: ignore[no-untyped-def]
    world, make_client, pattern,
):
    acme = world["acme"]
    url, row, echoed = _url(pattern, world)
    aimed_at_other_tenant = row is not None and type(row) in OWNED and has_tenancy(type(row))
    before = snapshot(acme)
    for role in ROLES:
        client = make_client(role, acme, username=f"acme-{role}")
        for method in _methods(pattern):
            kwargs: dict[str, Any] = {}
            if method in ("post", "put", "patch"):
                kwargs = {"data": json.dumps(_attack(world)), "content_type": "application/json"}
            response = getattr(client, method)(url, **kwargs)
            where = f"{role} {method.upper()} {url} → {response.status_code}"
            assert response.status_code < 500, f"{where}: {response.content[:300]!r}"
            if aimed_at_other_tenant:
                assert response.status_code in (403, 404), f"{where}: {response.content[:300]!r}"
            leaked = _leaks(response.content, echoed)
            assert not leaked, f"{where} shows {leaked}: {response.content[:400]!r}"
    assert snapshot(acme) == before, f"{url}: a row acme does not own changed"


@pytest.mark.parametrize("pattern", [p for p in ROUTES if not p.pattern.regex.groupindex],
                         ids=lambda p: str(p.pattern).strip("^$"))
def test_lists_never_hold_another_tenants_rows(world, make_client, pattern):  # type: ignore[no-untyped-def]
    """The same routes read by platform staff do show globex's rows and the addresses: the
    test above would catch a leak."""
    if "get" not in _methods(pattern):
        pytest.skip("no list here")
    url = _url(pattern, world)[0]
    for role in ROLES:
        response = make_client(role, world["acme"], username=f"acme-{role}").get(url)
        assert response.status_code in (200, 403), f"{role} GET {url}: {response.status_code}"
        if response.status_code == 200:
            assert not _leaks(response.content, ""), f"{role} GET {url}"


def test_platform_staff_see_what_tenant_users_may_not(world, make_client) -> None:  # type: ignore[no-untyped-def]
    """The oracle is not empty: the same reads by a platform viewer show every secret."""
    staff = make_client(Role.VIEWER)
    seen = b"".join(staff.get(f"/api/v1/{prefix}/").content
                    for prefix in ("deployments", "replicas", "edges", "operations", "plans"))
    assert not [word for word in SECRETS if word.lower() not in seen.decode().lower()]

"""Property: whatever deployments, aliases and policies the API accepts (or refuses), every
table the control plane signs is accepted by a real edge — an `python -m edge` process with
its signature check, admin HMAC and parser — so no input can freeze the fleet's tables."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core.models import Role
from controlplane.core.services import issue_api_key
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.lab.processes import die_with_parent
from controlplane.routing import edge_secrets, services, signing
from controlplane.routing.models import Edge
from edge.local import LocalEdge

pytestmark = pytest.mark.django_db(transaction=False)

EDGE = "edge-property"
# Names clients may send as `model`: a few that collide, dots, unicode, spaces, the longest.
NAMES = st.sampled_from(["auto", "fast", "llama-3.1-8b", "m.v1.2", "modèle", "a b", "x" * 96,
                         "", "gpt-4o"])
TENANTS = st.sampled_from(["acme", "globex", None])
URLS = st.sampled_from(["http://127.0.0.1:9", "https://10.0.0.1:8443/engine-3",
                        "http://[::1]:8000", "ftp://nowhere", "http://:80", "not a url"])
# What a JSON body can carry: no NaN or Infinity, which JSON has no words for (a body that
# spells them anyway is refused, see test_a_body_with_a_non_finite_number_is_refused).
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000)
    | st.floats(allow_nan=False, allow_infinity=False) | NAMES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["model", "default", "rules", "max_prompt_tokens",
                         "min_prompt_tokens", "tier", "other"]), inner, max_size=4),
    max_leaves=8)
RULE = st.fixed_dictionaries({"model": NAMES}, optional={
    "max_prompt_tokens": st.integers(-1, 4000), "min_prompt_tokens": st.integers(0, 10),
    "tier": st.sampled_from(["interactive", "batch", "gold"])})
ALIAS = NAMES | st.fixed_dictionaries({"rules": st.lists(RULE, max_size=3)},
                                      optional={"default": NAMES}) | JSON
POLICY = st.fixed_dictionaries({}, optional={
    "aliases": st.dictionaries(NAMES, ALIAS, max_size=3),
    "scorers": st.dictionaries(st.sampled_from(["latency", "load", "prefix", "cost"]),
                               st.floats(0, 5), max_size=4),
    "retry_before_first_byte": st.integers(0, 12),
    "eject_base_s": st.floats(0.01, 5),
    "first_byte_timeout_s": st.floats(0.5, 700),
    "max_table_age_s": st.integers(0, 40 * 24 * 3600),
    "stale_table_mode": st.sampled_from(["last_known_good", "fail_closed", "open"]),
    "fail_open_tenants": st.lists(st.sampled_from(["acme", "globex", "nobody"]), max_size=2),
})
DEPLOYMENT = st.fixed_dictionaries({
    "served_model_name": NAMES, "tenant": TENANTS,
    "replicas": st.lists(st.tuples(URLS, st.sampled_from([S.READY, S.DEGRADED, S.DRAINING])),
                         max_size=2)})
ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("deployment"), DEPLOYMENT),
    st.tuples(st.just("policy"), POLICY),
    st.tuples(st.just("key"), st.tuples(st.sampled_from(["acme", "globex"]), st.booleans())),
), min_size=1, max_size=5)


@pytest.fixture
def edge(catalog, tenants, signing_key_file) -> Iterator[LocalEdge]:  # type: ignore[no-untyped-def]
    local = LocalEdge(name=EDGE, region="aws:eu-central-1", key=signing.signing_key(),
                      admin_secret=edge_secrets.edge_secret(EDGE), preexec_fn=die_with_parent())
    local.start(timeout_s=30)
    Edge.objects.create(name=EDGE, region=catalog["fra"], admin_url=local.admin_url)
    try:
        yield local
    finally:
        local.close()


def apply(action: tuple[str, Any], clients: dict[str, Any], fx: dict[str, Any],
          serial: int) -> None:
    kind, spec = action
    if kind == "deployment":
        tenant = spec["tenant"]
        body = {"name": f"d{serial}", "served_model_name": spec["served_model_name"],
                "model": "llama-3.1-8b-instruct", "tenant": tenant,
                "allowed_jurisdictions": ["EU"], "user_regions": ["aws:eu-central-1"],
                "min_replicas": 1, "max_replicas": 2, "max_model_len": 8192}
        response = clients[tenant or "platform"].post("/api/v1/deployments/", body,
                                                      format="json")
        assert response.status_code in (201, 400), response.content
        if response.status_code == 201:
            deployment = Deployment.objects.get(name=f"d{serial}")
            for url, state in spec["replicas"]:
                Replica.objects.create(deployment=deployment, region=fx["fra"], state=state,
                                       url=url)
    elif kind == "policy":
        response = clients["admin"].patch(
            f"/api/v1/routing-policy/{services.current_policy().pk}/", spec, format="json")
        assert response.status_code in (200, 400), response.content
    else:
        tenant, revoke = spec
        key, _ = issue_api_key(fx[tenant], f"k{serial}", "interactive")
        if revoke:
            key.revoked_at = key.created_at
            key.save()


def test_every_signed_table_is_accepted_by_a_real_edge(catalog, tenants, make_client,
                                                       edge):  # type: ignore[no-untyped-def]
    fx = {**catalog, **tenants}
    clients = {"acme": make_client(Role.OPERATOR, tenants["acme"]),
               "globex": make_client(Role.OPERATOR, tenants["globex"]),
               "platform": make_client(Role.OPERATOR), "admin": make_client(Role.ADMIN)}
    serial = itertools.count()
    signed = []

    @settings(max_examples=15, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(ACTIONS)
    def example(actions: list[tuple[str, Any]]) -> None:
        # Each example starts from the fixtures' state; versions only grow (a sequence), so
        # the edge takes each example's tables as newer than the last.
        with transaction.atomic():
            for action in actions:
                apply(action, clients, fx, next(serial))
            report = services.publish(force=True)
            assert report.results, "a table is pushed"
            for result in report.results:
                assert (result.status, result.acked) == (200, True), result.detail
            assert edge.admin("/admin/table")["version"] == report.version
            signed.append(report.version)
            transaction.set_rollback(True)

    example()
    assert len(signed) >= 10

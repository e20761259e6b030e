"""Tables are parsed with the edge's own parser before they are signed: an entry it refuses
is left out and alerted on, and the rest of the table ships — also for rows saved before the
API checked them."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.alerts import services as alerts
from controlplane.alerts.models import Alert, AlertState, Rule
from controlplane.core.services import issue_api_key
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.routing import services
from controlplane.routing.models import RoutingPolicy, RoutingTable
from controlplane.routing.screening import screen_table
from edge.table import parse_table
from tests.api.test_endpoints_crud import make_deployment

ALIASES = {"auto": "llama-3.1-8b", "fast": {"rules": [], "default": "llama-3.1-8b"}}


def replica(replica_id: str, url: str = "http://127.0.0.1:9") -> dict[str, Any]:
    return {"id": replica_id, "url": url, "region": "aws:eu-central-1", "jurisdiction": "EU"}


def table(**parts: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"version": 1, "issued_at": "2026-01-01T00:00:00+00:00",
                            "edge": "e", "models": {}, "tenants": {}, "aliases": {}}
    return {**base, **parts}


def test_a_served_name_that_shadows_an_alias_loses_its_entry_not_the_alias() -> None:
    shipped, left_out = screen_table(
        table(models={"auto": {"replicas": [replica("r1")]},
                      "llama-3.1-8b": {"replicas": [replica("r2")]}}, aliases=ALIASES),
        model_owners={"auto": ["sneaky"]})
    assert set(shipped["models"]) == {"llama-3.1-8b"} and shipped["aliases"] == ALIASES
    assert [(e.subject, e.kind, e.field) for e in left_out] == [("sneaky", "model", "aliases.auto")]
    parse_table(shipped)


def test_one_bad_replica_goes_and_its_model_stays() -> None:
    shipped, left_out = screen_table(
        table(models={"llama-3.1-8b": {"replicas": [replica("r1"), replica("r2", "ftp://x")]}}),
        replica_owners={"r2": "chat-bad"})
    assert [r["id"] for r in shipped["models"]["llama-3.1-8b"]["replicas"]] == ["r1"]
    assert [(e.subject, e.kind, e.field) for e in left_out] == [
        ("chat-bad", "replica", "models.llama-3.1-8b.replicas[1].url")]


def test_a_bad_alias_a_bad_key_and_a_bad_policy_go_one_by_one() -> None:
    shipped, left_out = screen_table(table(
        models={"m.v1.2": {"replicas": [replica("r1")]}},
        aliases={**ALIASES, "broken": {"rules": "x"}},
        tenants={"a" * 64: {"tenant": "acme", "jurisdictions": ["EU"], "tier": "gold"},
                 "b" * 64: {"tenant": "acme", "jurisdictions": ["EU"]}},
        policy={"picker": "fastest"}))
    assert {(e.kind, e.subject) for e in left_out} == {
        ("tenant_key", f"tenant acme key {'a' * 12}"), ("policy", "routing policy"),
        ("alias", "alias broken")}
    assert set(shipped["tenants"]) == {"b" * 64} and "policy" not in shipped
    assert set(shipped["aliases"]) == set(ALIASES) and "m.v1.2" in shipped["models"]


@pytest.fixture
def fleet(catalog, tenants, admin_endpoints):  # type: ignore[no-untyped-def]
    from controlplane.routing.models import Edge

    fx = {**catalog, **tenants}
    chat = make_deployment(fx, "chat")
    Replica.objects.create(deployment=chat, region=catalog["fra"], state=S.READY,
                           url="http://127.0.0.1:9101")
    issue_api_key(tenants["acme"], "web", "interactive")
    edges = [Edge.objects.create(name=f"edge-{i}", region=catalog["fra"], admin_url=e.url)
             for i, e in enumerate(admin_endpoints)]
    return {**fx, "chat": chat, "edges": edges, "endpoints": admin_endpoints}


@pytest.mark.django_db
def test_rows_saved_before_validation_never_freeze_the_tables(fleet):  # type: ignore[no-untyped-def]
    # Saved straight to the database, as rows from before the API checked them were: another
    # tenant's deployment served as an existing alias, and a malformed alias.
    sneaky = Deployment.objects.create(name="sneaky", served_model_name="auto",
                                       model=fleet["llama8b"], tenant=fleet["globex"])
    Replica.objects.create(deployment=sneaky, region=fleet["fra"], state=S.READY,
                           url="http://127.0.0.1:9102")
    RoutingPolicy.objects.update_or_create(
        name="default", defaults={"aliases": {**ALIASES, "broken": {"rules": "x"}}})

    report = services.publish()
    assert report.acked == 3, [r.detail for r in report.results]
    assert report.version is not None
    for endpoint in fleet["endpoints"]:
        shipped = endpoint.received[-1]
        assert set(shipped["models"]) == {"llama-3.1-8b"}
        assert set(shipped["aliases"]) == set(ALIASES)
        parse_table(shipped)
    newest = RoutingTable.objects.filter(version=report.version).first()
    assert newest is not None
    assert {e["subject"] for e in newest.excluded} == {"sneaky", "alias broken"}

    alerts.evaluate()
    open_alerts = {a.subject: a for a in Alert.objects.filter(
        rule=Rule.TABLE_ENTRY_EXCLUDED, state=AlertState.OPEN)}
    assert set(open_alerts) == {"sneaky", "alias broken"}
    assert open_alerts["sneaky"].tenant == fleet["globex"]
    assert "aliases.auto" in open_alerts["sneaky"].message
    assert open_alerts["alias broken"].tenant is None

    # Fixed (the deployment renamed, the alias removed): the next tables have them all, and
    # the alerts resolve.
    Deployment.objects.filter(pk=sneaky.pk).update(served_model_name="sneaky-model")
    RoutingPolicy.objects.filter(name="default").update(aliases=ALIASES)
    fixed = services.publish()
    assert fixed.version is not None and fixed.version > report.version
    assert set(fleet["endpoints"][0].received[-1]["models"]) == {"llama-3.1-8b", "sneaky-model"}
    alerts.evaluate()
    assert not Alert.objects.filter(rule=Rule.TABLE_ENTRY_EXCLUDED,
                                    state=AlertState.OPEN).exists()


@pytest.mark.django_db
def test_tables_carry_revoked_keys_and_the_freshness_policy(fleet):  # type: ignore[no-untyped-def]
    from django.utils import timezone

    key, _ = issue_api_key(fleet["acme"], "old", "interactive")
    key.revoked_at = timezone.now()
    key.save()
    policy = services.current_policy()
    policy.max_table_age_s, policy.stale_table_mode = 3600, "fail_closed"
    policy.save()
    policy.fail_open_tenants.set([fleet["acme"]])
    services.publish()
    shipped = fleet["endpoints"][0].received[-1]
    assert shipped["revoked_keys"] == [key.key_hash]
    assert key.key_hash not in shipped["tenants"]
    assert (shipped["policy"]["max_table_age_s"], shipped["policy"]["stale_table_mode"]) == (
        3600, "fail_closed")
    assert all(rules["fail_open"] for rules in shipped["tenants"].values())

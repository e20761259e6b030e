"""A deployment whose placement rules are broken says so: `rule_violations` in the API (list
and detail) and on its dashboard pages, an alert, and the replan's proposal (applied only
where auto_apply_plans allows). The words come from one pure function
(`placement.rules.violations`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.alerts import services as alert_services
from controlplane.alerts.models import Alert
from controlplane.core.models import Role
from controlplane.core.services import ensure_user
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement import rules
from controlplane.placement.models import PlanStatus
from controlplane.plans.replan import replan
from regions.models import Offer
from tests.api.test_endpoints_crud import make_deployment

URL = "/api/v1/deployments/"
SQUEEZED = "spread_regions 3, serving in 1 region (aws:eu-central-1)"


def at(pk: int, region: str, jurisdiction: str = "EU", lat: float = 50.1,
       lon: float = 8.7) -> rules.Placed:
    return rules.Placed(pk, f"r-{pk}", region, jurisdiction, lat, lon)


def test_the_rules_in_words() -> None:
    eu = rules.Rules(3, frozenset({"EU"}))
    fra = [at(1, "aws:eu-central-1"), at(2, "aws:eu-central-1"), at(3, "aws:eu-central-1")]
    assert [str(v) for v in rules.violations(eu, fra)] == [SQUEEZED]
    spread = [at(1, "aws:eu-central-1"), at(2, "gcp:europe-west4"), at(3, "aws:eu-west-3")]
    assert rules.violations(eu, spread) == []
    assert rules.violations(eu, []) == []  # scaled to zero breaks nothing
    abroad = rules.violations(rules.Rules(1, frozenset({"EU"})),
                              [at(7, "aws:us-east-1", "US", 38.9, -77.4)])
    assert [(v.kind, str(v)) for v in abroad] == [(
        "residency", "r-7 serves in aws:us-east-1 (US), outside the allowed jurisdictions (EU)")]
    # Users in Frankfurt with a 100 ms TTFT SLO: 50 ms of network; Virginia is ~67 ms away.
    far = rules.violations(rules.Rules(1, frozenset({"EU", "US"}), ((50.1, 8.7),), 50.0),
                           [at(7, "aws:us-east-1", "US", 38.9, -77.4), at(8, "aws:eu-central-1")])
    assert [v.kind for v in far] == ["latency"]
    assert str(far[0]).startswith("r-7 serves in aws:us-east-1, ")
    assert str(far[0]).endswith("over the 50 ms its TTFT SLO leaves the network")


@pytest.fixture
def squeezed(catalog, tenants) -> Deployment:  # type: ignore[no-untyped-def]
    """acme's chat: spread_regions 3 over EU and US, all three replicas in Frankfurt (as two
    promoted rollouts left demo-chat)."""
    deployment = make_deployment({**catalog, **tenants}, "chat-squeezed")
    deployment.allowed_jurisdictions.set([catalog["eu"], catalog["us"]])
    deployment.user_regions.set([])
    Deployment.objects.filter(pk=deployment.pk).update(spread_regions=3, min_replicas=3,
                                                       max_replicas=4)
    deployment.refresh_from_db()
    offer = Offer.objects.get(region=catalog["fra"], gpu_type=catalog["h100"])
    for i in range(3):
        Replica.objects.create(deployment=deployment, region=catalog["fra"], offer=offer,
                               state=S.READY, ready_at=timezone.now(),
                               url=f"http://10.0.5.{i + 1}:8000")
    return deployment


def _row(response: Any, name: str) -> dict[str, Any]:
    assert response.status_code == 200, response.content
    return next(r for r in response.json()["results"] if r["name"] == name)


@pytest.mark.django_db
def test_a_broken_spread_shows_in_the_api_and_on_the_pages(  # type: ignore[no-untyped-def]
        squeezed, make_client, tenants, client):
    api = make_client(Role.VIEWER, tenants["acme"])
    assert _row(api.get(URL), "chat-squeezed")["rule_violations"] == [SQUEEZED]
    detail = api.get(f"{URL}chat-squeezed/")
    assert detail.status_code == 200 and detail.json()["rule_violations"] == [SQUEEZED]

    page = client
    page.force_login(ensure_user("viewer-acme-pages", Role.VIEWER, tenants["acme"]))
    body = page.get("/deployments/chat-squeezed/").content.decode()
    assert "data-rule-violations" in body and SQUEEZED in body
    assert "auto_apply_plans is off" in body
    listing = page.get("/deployments/").content.decode()
    assert "rules broken" in listing and SQUEEZED in listing

    # Spread again: nothing to say.
    first, *_, last = Replica.objects.filter(deployment=squeezed).order_by("id")
    Replica.objects.filter(pk=first.pk).update(
        region=Offer.objects.get(region__code="us-east-1", gpu_type__name="H100").region)
    Replica.objects.filter(pk=last.pk).update(
        region=Offer.objects.get(region__code="europe-west4", gpu_type__name="H100").region)
    assert api.get(f"{URL}chat-squeezed/").json()["rule_violations"] == []
    assert "data-rule-violations" not in page.get("/deployments/chat-squeezed/").content.decode()


@pytest.mark.django_db
def test_rule_violations_are_read_only_and_stay_with_their_tenant(  # type: ignore[no-untyped-def]
        squeezed, make_client, tenants):
    operator = make_client(Role.OPERATOR, tenants["acme"])
    answer = operator.patch(f"{URL}chat-squeezed/", {"rule_violations": []}, format="json")
    assert answer.status_code == 400 and "rule_violations" in answer.json(), answer.content
    # Another tenant neither reads nor lists them.
    other = make_client(Role.ADMIN, tenants["globex"])
    assert other.get(f"{URL}chat-squeezed/").status_code == 404
    assert "chat-squeezed" not in [r["name"] for r in other.get(URL).json()["results"]]


@pytest.mark.django_db
def test_a_broken_rule_opens_an_alert_and_the_replan_proposes_without_applying(  # type: ignore[no-untyped-def]
        squeezed):
    now = timezone.now()
    alert_services.evaluate(now)
    assert not Alert.objects.filter(rule="rule_violated").exists()  # held for a minute first
    alert_services.evaluate(now + timedelta(seconds=61))
    alert = Alert.objects.get(rule="rule_violated", subject="chat-squeezed")
    assert alert.state == "open" and alert.severity == "warning"
    assert SQUEEZED in alert.message and "nothing moves until an operator" in alert.message
    assert alert.tenant_id == squeezed.tenant_id

    outcome = replan()
    assert "spread" in [b.kind for b in outcome.broken]
    assert outcome.plan is not None and outcome.plan.status == PlanStatus.PROPOSED
    assert outcome.action == "proposed"
    assert "chat-squeezed apply plans by hand" in outcome.reason
    assert {c.region.code for c in outcome.plan.changes.filter(action="add")} >= {"us-east-1"}

    # Spread again: the alert resolves.
    replicas = list(Replica.objects.filter(deployment=squeezed).order_by("id"))
    Replica.objects.filter(pk=replicas[0].pk).update(
        region=Offer.objects.get(region__code="us-east-1", gpu_type__name="H100").region)
    Replica.objects.filter(pk=replicas[1].pk).update(
        region=Offer.objects.get(region__code="europe-west4", gpu_type__name="H100").region)
    alert_services.evaluate(now + timedelta(seconds=120))
    alert.refresh_from_db()
    assert alert.state == "resolved"


@pytest.mark.django_db
def test_with_auto_apply_the_replan_repairs_it(squeezed):  # type: ignore[no-untyped-def]
    Deployment.objects.filter(pk=squeezed.pk).update(auto_apply_plans=True)
    outcome = replan()
    assert outcome.action == "applied", outcome.reason
    assert outcome.plan is not None and outcome.plan.status == PlanStatus.APPLYING

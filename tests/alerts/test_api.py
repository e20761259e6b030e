"""The alerts API: lists with filters, 400s naming the parameter, tenancy, acknowledging."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from controlplane.alerts.models import Alert, AlertState, Rule, RuleSetting
from controlplane.core.models import AuditLog, Role

pytestmark = pytest.mark.django_db

URL = "/api/v1/alerts/"


def _alert(rule: str, subject: str, tenant: Any = None, severity: str = "warning",
           resolved: bool = False) -> Alert:
    now = timezone.now()
    return Alert.objects.create(
        rule=rule, subject=subject, tenant=tenant, severity=severity, message=f"{subject} bad",
        value=1.0, threshold=0.8, firing_since=now, opened_at=now, last_evaluated_at=now,
        state=AlertState.RESOLVED if resolved else AlertState.OPEN,
        resolved_at=now if resolved else None)


@pytest.fixture
def alerts(tenants: dict[str, Any]) -> dict[str, Alert]:
    return {
        "acme": _alert(Rule.BUDGET, "acme", tenants["acme"], "critical"),
        "acme_old": _alert(Rule.TTFT_SLO, "chat", tenants["acme"], resolved=True),
        "globex": _alert(Rule.BUDGET, "globex", tenants["globex"]),
        "region": _alert(Rule.REGION_DOWN, "aws:eu-central-1", None, "critical"),
    }


def _subjects(response: Any) -> list[str]:
    assert response.status_code == 200, response.json()
    return sorted(row["subject"] for row in response.json()["results"])


def test_platform_staff_list_and_filter(make_client, alerts):  # type: ignore[no-untyped-def]
    client = make_client(Role.VIEWER)
    assert _subjects(client.get(URL)) == ["acme", "aws:eu-central-1", "chat", "globex"]
    assert _subjects(client.get(URL, {"state": "open"})) == ["acme", "aws:eu-central-1",
                                                             "globex"]
    assert _subjects(client.get(URL, {"state": "resolved"})) == ["chat"]
    assert _subjects(client.get(URL, {"rule": "budget", "severity": "critical"})) == ["acme"]
    assert _subjects(client.get(URL, {"tenant": "globex"})) == ["globex"]
    row = client.get(f"{URL}{alerts['acme'].pk}/").json()
    assert row["tenant"] == "acme" and row["rule_display"] == "Monthly budget"
    assert row["state"] == "open" and row["resolved_at"] is None
    assert row["notify_state"] == "none" and row["duration_s"] == 0.0


@pytest.mark.parametrize(("params", "field"), [
    ({"state": "closed"}, "state"),
    ({"rule": "cpu"}, "rule"),
    ({"severity": "fatal"}, "severity"),
    ({"since": "yesterday"}, "since"),
    ({"acknowledged": "maybe"}, "acknowledged"),
])
def test_bad_filter_values_are_400_naming_the_parameter(  # type: ignore[no-untyped-def]
    make_client, alerts, params, field,
):
    response = make_client(Role.VIEWER).get(URL, params)
    assert response.status_code == 400
    assert list(response.json()) == [field]


def test_tenants_see_only_their_own_alerts(make_client, tenants, alerts):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN, tenants["acme"])
    assert _subjects(client.get(URL)) == ["acme", "chat"]
    assert client.get(f"{URL}{alerts['globex'].pk}/").status_code == 404
    assert client.get(f"{URL}{alerts['region'].pk}/").status_code == 404
    assert client.post(f"{URL}{alerts['globex'].pk}/acknowledge/", {}).status_code == 404


def test_operators_acknowledge_open_alerts(make_client, alerts):  # type: ignore[no-untyped-def]
    url = f"{URL}{alerts['region'].pk}/acknowledge/"
    viewer = make_client(Role.VIEWER)
    response = viewer.post(url, {"note": "looking"}, format="json")
    assert response.status_code == 403 and "operator" in response.json()["detail"]

    operator = make_client(Role.OPERATOR)
    response = operator.post(url, {"note": "provider incident 123"}, format="json")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["acknowledged_by"] == "operator-platform"
    assert body["acknowledge_note"] == "provider incident 123" and body["acknowledged_at"]
    event = AuditLog.objects.get(action="alert.acknowledged")
    assert event.actor == "operator-platform" and event.object_id == str(alerts["region"].pk)

    again = operator.post(url, {}, format="json")
    assert again.status_code == 409 and "Already acknowledged by operator-platform" in \
        again.json()["detail"]
    resolved = operator.post(f"{URL}{alerts['acme_old'].pk}/acknowledge/", {}, format="json")
    assert resolved.status_code == 409 and "resolved" in resolved.json()["detail"]
    assert _subjects(operator.get(URL, {"acknowledged": "true"})) == ["aws:eu-central-1"]
    assert _subjects(operator.get(URL, {"acknowledged": "false"})) == ["acme", "chat", "globex"]


@pytest.mark.parametrize("note", ["x" * 501, {"text": "hi"}, None])
def test_acknowledge_rejects_bad_notes(make_client, alerts, note):  # type: ignore[no-untyped-def]
    url = f"{URL}{alerts['region'].pk}/acknowledge/"
    response = make_client(Role.OPERATOR).post(url, {"note": note}, format="json")
    assert response.status_code == 400 and list(response.json()) == ["note"]
    assert Alert.objects.get(pk=alerts["region"].pk).acknowledged_at is None


def test_a_tenant_operator_acknowledges_its_own_alert(make_client, tenants, alerts):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR, tenants["acme"])
    response = client.post(f"{URL}{alerts['acme'].pk}/acknowledge/", {}, format="json")
    assert response.status_code == 200 and response.json()["acknowledged_by"] == "operator-acme"


def test_alerts_are_read_only(make_client, alerts):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN)
    assert client.post(URL, {"rule": "budget"}, format="json").status_code == 405
    assert client.delete(f"{URL}{alerts['acme'].pk}/").status_code == 405
    assert make_client(None).get(URL).status_code == 401


def test_rule_thresholds_endpoint_shows_overrides(make_client, db):  # type: ignore[no-untyped-def]
    RuleSetting.objects.create(rule=Rule.ERROR_RATE, warning=0.02, for_s=120)
    rows = {r["rule"]: r for r in make_client(Role.VIEWER).get("/api/v1/alert-rules/").json()}
    assert set(rows) == set(Rule.values)
    assert rows["error_rate"] == {"rule": "error_rate", "description": "Error rate (5xx share)",
                                  "enabled": True, "warning": 0.02, "critical": 0.2,
                                  "for_s": 120, "window_s": 300}
    assert rows["edge_table_stale"]["warning"] == 30


def test_schema_describes_the_alert_endpoints(make_client, db):  # type: ignore[no-untyped-def]
    response = make_client(Role.VIEWER).get("/api/schema/", {"format": "json"})
    paths = response.json()["paths"]
    assert {"/api/v1/alerts/", "/api/v1/alerts/{id}/", "/api/v1/alerts/{id}/acknowledge/",
            "/api/v1/alert-rules/"} <= set(paths)
    params = {p["name"] for p in paths["/api/v1/alerts/"]["get"]["parameters"]}
    assert {"state", "rule", "severity", "since"} <= params

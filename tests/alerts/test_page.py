"""The dashboard's Alerts page and the overview's open-alerts figure."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.alerts.models import Alert, AlertState, Rule
from controlplane.core.models import Role
from controlplane.core.services import ensure_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def sign_in(client: Any) -> Callable[..., Any]:
    def sign(role: str, tenant: Any = None) -> Any:
        name = f"{role}-{tenant.name if tenant else 'platform'}"
        client.force_login(ensure_user(name, role, tenant))
        return client

    return sign


def _alert(rule: str, subject: str, tenant: Any = None, severity: str = "warning",
           age_s: int = 60, resolved_after_s: int | None = None) -> Alert:
    opened = timezone.now() - timedelta(seconds=age_s)
    resolved = opened + timedelta(seconds=resolved_after_s) if resolved_after_s else None
    return Alert.objects.create(
        rule=rule, subject=subject, tenant=tenant, severity=severity,
        message=f"Message about {subject}.", firing_since=opened, opened_at=opened,
        last_evaluated_at=resolved or timezone.now(), resolved_at=resolved,
        state=AlertState.RESOLVED if resolved else AlertState.OPEN)


@pytest.fixture
def alerts(tenants: dict[str, Any]) -> dict[str, Alert]:
    return {
        "warn": _alert(Rule.EDGE_TABLE_STALE, "edge-eu", age_s=30),
        "crit": _alert(Rule.REGION_DOWN, "aws:eu-central-1", severity="critical", age_s=600),
        "acme": _alert(Rule.BUDGET, "acme", tenants["acme"], "critical", age_s=120),
        "old": _alert(Rule.TTFT_SLO, "chat", tenants["acme"], age_s=7200,
                      resolved_after_s=900),
        "globex": _alert(Rule.BUDGET, "globex", tenants["globex"], age_s=90),
    }


def _section(html: str, title: str) -> str:
    return html.split(f"<h2>{title}</h2>", 1)[1].split("</section>", 1)[0]


def test_open_alerts_come_first_worst_first_then_resolved(sign_in, alerts):  # type: ignore[no-untyped-def]
    response = sign_in(Role.VIEWER).get("/alerts/")
    assert response.status_code == 200
    html = response.content.decode()
    opened = _section(html, "Open")
    order = [opened.index(f'id="alert-{alerts[k].pk}"') for k in ("acme", "crit", "warn",
                                                                    "globex")]
    assert order == sorted(order)  # critical newest first, then warnings newest first
    assert "Message about aws:eu-central-1." in opened and "10 min ago" in opened
    resolved = _section(html, "Resolved")
    assert f'id="alert-{alerts["old"].pk}"' in resolved and "15\xa0minutes" in resolved
    assert f'id="alert-{alerts["old"].pk}"' not in opened
    assert "Acknowledge</button>" not in html  # viewers get no buttons
    assert "4 open: 2 critical, 2 warning." in html


def test_filters_and_bad_filter_values(sign_in, alerts):  # type: ignore[no-untyped-def]
    client = sign_in(Role.VIEWER)
    html = client.get("/alerts/", {"rule": "budget"}).content.decode()
    assert "Message about acme." in html and "Message about edge-eu." not in html
    html = client.get("/alerts/", {"severity": "loud"}).content.decode()
    assert 'class="form-error"' in html and "severity:" in html
    assert "Message about" not in html


def test_tenants_see_only_their_alerts(sign_in, tenants, alerts):  # type: ignore[no-untyped-def]
    html = sign_in(Role.ADMIN, tenants["acme"]).get("/alerts/").content.decode()
    assert "Message about acme." in html and "Message about chat." in html
    assert "Message about globex." not in html and "Message about edge-eu." not in html
    assert "1 open: 1 critical, 0 warning." in html


def test_operators_acknowledge_from_the_page(sign_in, tenants, alerts):  # type: ignore[no-untyped-def]
    viewer = sign_in(Role.VIEWER)
    url = f"/alerts/{alerts['crit'].pk}/acknowledge/"
    assert viewer.post(url, {"note": "x"}).status_code == 403

    operator = sign_in(Role.OPERATOR)
    assert "Acknowledge</button>" in operator.get("/alerts/").content.decode()
    assert operator.post(url, {"note": "x" * 501}).status_code == 302
    assert Alert.objects.get(pk=alerts["crit"].pk).acknowledged_at is None
    response = operator.post(url, {"note": "on it"}, follow=True)
    assert "acknowledged." in response.content.decode()
    alert = Alert.objects.get(pk=alerts["crit"].pk)
    assert alert.acknowledged_by == "operator-platform" and alert.acknowledge_note == "on it"
    assert "on it" in _section(response.content.decode(), "Open")
    assert operator.get(url).status_code == 405

    tenant_operator = sign_in(Role.OPERATOR, tenants["acme"])
    other = f"/alerts/{alerts['globex'].pk}/acknowledge/"
    assert tenant_operator.post(other, {}).status_code == 404


def test_overview_counts_open_alerts(sign_in, tenants, alerts):  # type: ignore[no-untyped-def]
    response = sign_in(Role.VIEWER).get("/")
    assert response.context["alerts_open"] == {"total": 4, "critical": 2, "warning": 2}
    assert "2 critical, 2 warning." in response.content.decode()
    tenant = sign_in(Role.VIEWER, tenants["globex"]).get("/live/overview/?part=figures")
    assert tenant.context["alerts_open"] == {"total": 1, "critical": 0, "warning": 1}


def test_page_queries_do_not_grow_with_alerts(sign_in, alerts):  # type: ignore[no-untyped-def]
    client = sign_in(Role.OPERATOR)

    def count() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert client.get("/alerts/").status_code == 200
        return len(queries)

    small = count()
    for i in range(150):
        _alert(Rule.QUOTA_EXHAUSTED, f"r{i}/H100", age_s=i + 10)
        _alert(Rule.BUDGET, f"t{i}", age_s=i + 10, resolved_after_s=5)
    assert count() == small <= 12


def test_admin_lists_alerts_and_validates_rule_settings(client, alerts):  # type: ignore[no-untyped-def]
    from django.contrib.auth import get_user_model

    from controlplane.alerts.models import RuleSetting
    from controlplane.core.models import AuditLog

    client.force_login(get_user_model().objects.create_superuser("root", "root@example.org",
                                                                 "pw-root"))
    assert client.get("/admin/alerts/alert/").status_code == 200
    assert client.get(f"/admin/alerts/alert/{alerts['crit'].pk}/change/").status_code == 200
    add = "/admin/alerts/rulesetting/add/"
    response = client.post(add, {"rule": "budget", "enabled": "on", "warning": "1.5"})
    assert response.status_code == 200
    assert "Must be at least the warning threshold (1.5)" in response.content.decode()
    response = client.post(add, {"rule": "budget", "enabled": "on", "warning": "0.5"})
    assert response.status_code == 302
    assert RuleSetting.objects.get().warning == 0.5
    assert AuditLog.objects.filter(action="create", object_type="alerts.rulesetting").exists()
    assert "0.8 / 1.0 / 0 s / 60 s" in client.get("/admin/alerts/rulesetting/").content.decode()

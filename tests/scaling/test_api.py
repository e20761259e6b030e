"""Scaling decisions where people read them: GET /api/v1/scaling-decisions/ and the deployment
page's "Scaling decisions" section."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.core.models import Role
from controlplane.deployments.models import Deployment
from controlplane.scaling.models import ScalingDecision

pytestmark = pytest.mark.django_db

URL = "/api/v1/scaling-decisions/"


@pytest.fixture
def decisions(catalog, tenants) -> dict[str, Deployment]:  # type: ignore[no-untyped-def]
    made = {}
    for name, tenant in (("chat-acme", tenants["acme"]), ("chat-globex", tenants["globex"]),
                         ("chat-shared", None)):
        d = Deployment.objects.create(name=name, served_model_name=name, tenant=tenant,
                                      model=catalog["llama8b"], max_replicas=8)
        d.allowed_jurisdictions.set([catalog["eu"]])
        made[name] = d
    now = timezone.now()
    ScalingDecision.objects.bulk_create([
        ScalingDecision(deployment=made["chat-acme"], at=now - timedelta(minutes=5),
                        direction="up", replicas_before=2, replicas_after=3,
                        reason="queue 6.0 waiting/replica ≥ 1 for 4 s",
                        signals={"inflight": 60, "waiting": 12, "kv_mean": 0.5,
                                 "ttft_p95_ms": 950.0, "sustained_s": {"queue": 4.0}},
                        placed=["gcp:europe-west4"]),
        ScalingDecision(deployment=made["chat-acme"], at=now - timedelta(minutes=1),
                        direction="down", replicas_before=3, replicas_after=2,
                        reason="in-flight peak 10 below 60% of what 2 replica(s) hold",
                        signals={"inflight": 10, "waiting": 0, "kv_mean": 0.1,
                                 "retired": ["r-7"]}),
        ScalingDecision(deployment=made["chat-globex"], at=now, direction="up",
                        replicas_before=1, replicas_after=2, reason="KV cache 95% ≥ 90% for 4 s",
                        signals={"kv_mean": 0.95}, placed=["aws:eu-central-1"]),
        ScalingDecision(deployment=made["chat-shared"], at=now, direction="up",
                        replicas_before=0, replicas_after=1, reason="scale from zero",
                        signals={"unserved_requests": 3}, placed=["aws:eu-central-1"]),
    ])
    return made


def _names(response: Any) -> list[str]:
    assert response.status_code == 200, response.content
    return [row["deployment"] for row in response.json()["results"]]


def test_platform_users_read_every_decision_newest_first(make_client, decisions):  # type: ignore[no-untyped-def]
    client = make_client(Role.VIEWER)
    rows = client.get(URL).json()["results"]
    assert len(rows) == 4
    assert [r["at"] for r in rows] == sorted((r["at"] for r in rows), reverse=True)
    up = next(r for r in rows if r["deployment"] == "chat-acme" and r["direction"] == "up")
    assert up["placed"] == ["gcp:europe-west4"] and up["signals"]["waiting"] == 12
    assert (up["replicas_before"], up["replicas_after"]) == (2, 3)
    assert _names(client.get(URL, {"deployment": "chat-acme"})) == ["chat-acme"] * 2
    assert _names(client.get(URL, {"deployment": "chat-acme", "direction": "down"})) == [
        "chat-acme"]


def test_tenants_see_only_their_own_and_shared_decisions(make_client, tenants, decisions):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN, tenants["acme"])
    assert sorted(_names(client.get(URL))) == ["chat-acme", "chat-acme", "chat-shared"]
    assert _names(client.get(URL, {"deployment": "chat-globex"})) == []
    theirs = ScalingDecision.objects.get(deployment=decisions["chat-globex"])
    assert client.get(f"{URL}{theirs.pk}/").status_code == 404


def test_decisions_are_read_only(make_client, decisions):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN)
    decision = ScalingDecision.objects.first()
    assert decision is not None
    assert client.post(URL, {"deployment": "chat-acme"}, format="json").status_code == 405
    assert client.delete(f"{URL}{decision.pk}/").status_code == 405
    assert make_client(None).get(URL).status_code == 401


def test_deployment_page_lists_decisions_with_their_signals(client, tenants, decisions):  # type: ignore[no-untyped-def]
    from controlplane.core.services import ensure_user

    client.force_login(ensure_user("viewer-acme", Role.VIEWER, tenants["acme"]))
    page = client.get("/deployments/chat-acme/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "Scaling decisions" in html
    assert "queue 6.0 waiting/replica ≥ 1 for 4 s" in html
    assert "gcp:europe-west4" in html and "drained r-7" in html
    assert "TTFT p95 950 ms" in html
    assert "KV cache 95%" not in html  # globex's decision stays on globex's page


def test_deployment_page_queries_do_not_grow_with_decisions(client, decisions):  # type: ignore[no-untyped-def]
    from controlplane.core.services import ensure_user

    client.force_login(ensure_user("operator-platform", Role.OPERATOR, None))

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/deployments/chat-acme/").status_code == 200
        return len(captured)

    few = queries()
    now = timezone.now()
    ScalingDecision.objects.bulk_create([
        ScalingDecision(deployment=decisions["chat-acme"], at=now - timedelta(seconds=i),
                        direction="up", replicas_before=1, replicas_after=2, reason=f"r{i}",
                        signals={"inflight": i}, placed=["aws:eu-central-1"])
        for i in range(40)])
    assert queries() == few

"""The rollouts pages: each rollout's timeline with its steps' figures and decisions, the
revisions side by side, and the buttons platform operators steer it with (POST, CSRF,
audited); tenant users see only rollouts of deployments they may see."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.core.models import AuditLog, Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.rollouts import analyst, lifecycle
from controlplane.rollouts.models import Rollout
from tests.rollouts.starting import start_rollout

pytestmark = pytest.mark.django_db


def judged(verdict: str, stable_ttft: float, canary_ttft: float, canary_errors: float = 0,
           ) -> dict[str, Any]:
    """A step's analysis as analyst.step_figures writes it."""
    def side(revision: int, ttft: float, errors: float) -> dict[str, Any]:
        return {"revision": revision, "edges": 2, "requests": 200.0, "errors": errors,
                "error_rate": errors / 200, "ttft_p95_s": ttft, "itl_p95_s": 0.02}
    checks = [{"name": "ttft_vs_stable", "value": canary_ttft, "limit": 1.2 * stable_ttft,
               "passed": canary_ttft <= 1.2 * stable_ttft,
               "says": f"canary TTFT p95 {canary_ttft:.3f} s against 1.2× the stable "
                       f"revision's {stable_ttft:.3f} s"}]
    return {"verdict": verdict, "why": "figures", "checks": checks,
            "stable": side(1, stable_ttft, 0), "canary": side(2, canary_ttft, canary_errors)}


@pytest.fixture
def rollout(fleet):  # type: ignore[no-untyped-def]
    rollout = start_rollout(fleet.acme, actor="ops", steps=[10, 50, 100], bake_s=30)
    Replica.objects.filter(revision=rollout.to_revision).update(state=S.READY)
    assert analyst.check() == {str(rollout.pk): "live"}
    lifecycle.advance(rollout.pk, actor=analyst.ANALYST,
                     figures=judged("pass", stable_ttft=0.2, canary_ttft=0.21))
    return Rollout.objects.get(pk=rollout.pk)


def test_the_timeline_shows_each_steps_figures_and_decision(signed_in, rollout):  # type: ignore[no-untyped-def]
    response = signed_in(Role.VIEWER).get(f"/rollouts/{rollout.pk}/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "Rollout" in html and rollout.deployment.name in html
    first, second = response.context["rows"]
    assert first["step"].decision == "advanced" and first["ttft"] == "200 ms / 210 ms"
    assert first["requests"] == "200 / 200" and first["errors"] == "0.0% / 0.0%"
    # The second step waits for the canary replicas 50% needs: the tables keep 10%.
    assert not second["live"] and second["step"].weight == 50
    assert 'id="canary-share">10%</b>' in html and "waiting for canary replicas" in html
    figure = response.context["figure"]
    ttft = [t for t in figure["data"] if "TTFT" in t["hovertemplate"]]
    assert [t["y"] for t in ttft] == [[200.0, None], [210.0, None]]
    assert [t["x"] for t in ttft] == [["1: 10%", "2: 50%"]] * 2
    assert figure["data"][1]["xaxis"] == "x2"  # 5xx beside TTFT
    # Viewers see no buttons.
    assert "Roll back</button>" not in html and "Pause</button>" not in html


def test_a_rolled_back_step_shows_the_failed_checks(signed_in, rollout):  # type: ignore[no-untyped-def]
    lifecycle.roll_back(rollout.pk, actor=analyst.ANALYST, reason="canary TTFT p95 over",
                       figures=judged("fail", stable_ttft=0.2, canary_ttft=0.9))
    html = signed_in(Role.VIEWER).get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "rolled_back" in html
    assert "canary TTFT p95 0.900 s against 1.2× the stable revision&#x27;s 0.200 s: over" in html


def test_a_platform_operator_pauses_resumes_and_rolls_back_from_the_page(signed_in, rollout):  # type: ignore[no-untyped-def]
    client = signed_in(Role.OPERATOR)
    page = client.get(f"/rollouts/{rollout.pk}/")
    assert [name for name, _ in page.context["actions"]] == ["pause", "promote", "rollback"]
    response = client.post(f"/rollouts/{rollout.pk}/pause/", {"reason": "look first"},
                           follow=True)
    assert "Pause: rollout" in response.content.decode()
    assert Rollout.objects.get(pk=rollout.pk).state == "paused"
    event = AuditLog.objects.get(action="rollout.paused")
    assert event.actor == "operator-platform" and event.reason == "look first"
    assert [n for n, _ in response.context["actions"]] == ["resume", "promote", "rollback"]
    # An action the state does not allow says why and changes nothing.
    refused = client.post(f"/rollouts/{rollout.pk}/pause/", follow=True)
    assert "Nothing done: rollout" in refused.content.decode()
    assert AuditLog.objects.filter(action="rollout.paused").count() == 1
    client.post(f"/rollouts/{rollout.pk}/resume/")
    client.post(f"/rollouts/{rollout.pk}/rollback/", {"reason": "by hand"})
    rolled = Rollout.objects.get(pk=rollout.pk)
    assert rolled.state == "rolled_back" and rolled.ended_by == "operator-platform"
    assert rolled.deployment.canary_weight == 0


def test_a_too_long_reason_is_refused_naming_the_field(signed_in, rollout):  # type: ignore[no-untyped-def]
    response = signed_in(Role.OPERATOR).post(f"/rollouts/{rollout.pk}/rollback/",
                                             {"reason": "x" * 501}, follow=True)
    assert "Nothing done: reason:" in response.content.decode()
    assert Rollout.objects.get(pk=rollout.pk).state == "running"
    assert not AuditLog.objects.filter(action="rollout.rolled_back").exists()


def test_a_blue_green_rollout_says_so(signed_in, fleet):  # type: ignore[no-untyped-def]
    rollout = start_rollout(fleet.acme, actor="ops", strategy="blue_green", bake_s=30,
                             rollback_window_s=120)
    client = signed_in(Role.VIEWER)
    assert "Blue/green" in client.get("/rollouts/").content.decode()
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "the old set kept 120 s after the switch" in html
    assert 'id="canary-share">0%</b>' in html  # until the new set serves
    analyst.check()
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "Waiting for" in html and "canary replicas to serve 100%: 0 serving" in html


def test_a_rollout_in_waves_shows_its_waves(signed_in, fleet, catalog):  # type: ignore[no-untyped-def]
    rollout = start_rollout(fleet.acme, actor="ops", steps=[10, 100], bake_s=30,
                             waves=[[catalog["fra"].key], [catalog["iad"].key]])
    html = signed_in(Role.VIEWER).get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "in 2 waves of edge regions" in html and "now wave 1" in html
    assert 'id="step-0-0"' in html


def test_an_unknown_action_is_404(signed_in, rollout):  # type: ignore[no-untyped-def]
    assert signed_in(Role.OPERATOR).post(f"/rollouts/{rollout.pk}/explode/").status_code == 404


@pytest.mark.parametrize("who", ["viewer", "tenant-operator"])
def test_viewers_and_tenant_operators_are_refused(signed_in, rollout, tenants, who):  # type: ignore[no-untyped-def]
    client = (signed_in(Role.VIEWER) if who == "viewer"
              else signed_in(Role.OPERATOR, tenants["acme"]))
    assert client.post(f"/rollouts/{rollout.pk}/rollback/").status_code == 403
    assert Rollout.objects.get(pk=rollout.pk).state == "running"
    assert not AuditLog.objects.filter(action="rollout.rolled_back").exists()


def test_tenant_users_see_rollouts_of_their_deployments_only(signed_in, rollout, tenants):  # type: ignore[no-untyped-def]
    acme = signed_in(Role.VIEWER, tenants["acme"])
    assert acme.get(f"/rollouts/{rollout.pk}/").status_code == 200
    assert f"rollout-{rollout.pk}" in acme.get("/rollouts/").content.decode()
    globex = signed_in(Role.VIEWER, tenants["globex"])
    assert globex.get(f"/rollouts/{rollout.pk}/").status_code == 404
    assert f"rollout-{rollout.pk}" not in globex.get("/rollouts/").content.decode()


def test_the_list_pages_queries_do_not_grow_with_the_rollouts(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.VIEWER)

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/rollouts/").status_code == 200
        return len(captured)

    def one_more(deployment: Any) -> None:
        rollout = start_rollout(deployment, actor="ops", steps=[100], bake_s=30)
        lifecycle.roll_back(rollout.pk, actor="ops")

    one_more(fleet.acme)
    few = queries()
    for _ in range(5):
        one_more(fleet.acme)
        one_more(fleet.globex)
    assert queries() == few


def test_a_canary_answering_only_errors_shows_no_latency_and_its_5xx_beside(signed_in, rollout):  # type: ignore[no-untyped-def]
    """Latency counts successful answers only: a canary whose every answer was a 5xx has no
    TTFT to look fast with, and says why; the chart's TTFT bars carry the 5xx rate."""
    failing = judged("fail", stable_ttft=0.2, canary_ttft=0.002, canary_errors=200)
    failing["canary"].update(ttft_p95_s=None, itl_p95_s=None)
    failing["checks"] = []
    lifecycle.roll_back(rollout.pk, actor=analyst.ANALYST, reason="canary 5xx", figures=failing)
    response = signed_in(Role.VIEWER).get(f"/rollouts/{rollout.pk}/")
    rows = response.context["rows"]
    last = rows[-1]
    assert last["ttft"] == "200 ms / none (all 5xx)" and last["errors"] == "0.0% / 100.0%"
    ttft = [t for t in response.context["figure"]["data"] if "TTFT" in t["hovertemplate"]]
    canary = ttft[1]
    assert canary["y"][-1] is None and canary["customdata"][-1] == 100.0
    assert "5xx %{customdata}%" in canary["hovertemplate"]

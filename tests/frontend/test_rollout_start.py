"""Starting a rollout from the dashboard: platform operators fill in the new revision's
settings, the strategy, steps, bake time and thresholds (POST with CSRF, audited); a wrong
field is shown by name with nothing made; others are refused."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from controlplane.core.models import AuditLog, Role
from controlplane.deployments.models import Revision
from controlplane.rollouts.models import Rollout

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(make_user) -> Client:  # type: ignore[no-untyped-def]
    """A platform operator's browser: CSRF checked as in production."""
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user(Role.OPERATOR))
    return client


def post(client: Client, body: dict[str, Any], token: bool = True) -> Any:
    page = client.get("/rollouts/")
    assert page.status_code == 200
    data = {"strategy": "canary", "bake_s": "60", **body}
    if token:
        data["csrfmiddlewaretoken"] = client.cookies["csrftoken"].value
    return client.post("/rollouts/start/", data)


def test_an_operator_starts_a_rollout_from_the_rollouts_page(operator, fleet, catalog):  # type: ignore[no-untyped-def]
    page = operator.get("/rollouts/").content.decode()
    assert 'id="rollout-start"' in page and "csrfmiddlewaretoken" in page
    response = post(operator, {
        "deployment": fleet.acme.name, "steps": "10, 50, 100", "bake_s": "120",
        "vllm_version": "0.11.1", "engine_args": '{"max_model_len": 4096}',
        "preferred_gpu_type": "H100", "ttft_ratio": "1.5", "reason": "new vLLM"})
    assert response.status_code == 302, response.content.decode()[:2000]
    rollout = Rollout.objects.get()
    assert response["Location"] == f"/rollouts/{rollout.pk}/"
    assert (rollout.steps, rollout.bake_s, rollout.state) == ([10, 50, 100], 120, "running")
    assert rollout.thresholds["ttft_ratio"] == 1.5 and rollout.thresholds["itl_ratio"] == 1.2
    revision = rollout.to_revision
    assert revision.vllm_version == "0.11.1" and revision.engine_args["max_model_len"] == 4096
    assert revision.preferred_gpu_type == catalog["h100"]
    event = AuditLog.objects.get(action="rollout.started")
    assert event.actor == "operator-platform" and event.reason == "new vLLM"


def test_without_the_csrf_token_nothing_starts(operator, fleet):  # type: ignore[no-untyped-def]
    response = post(operator, {"deployment": fleet.acme.name}, token=False)
    assert response.status_code == 403
    assert not Rollout.objects.exists()


@pytest.mark.parametrize(("body", "field", "says"), [
    ({"steps": "50, 25, 100"}, "steps", "weights must increase"),
    ({"steps": "5, 25, 50"}, "steps", "the last step must be 100"),
    ({"steps": "ten, 100"}, "steps", "whole percentages"),
    ({"bake_s": "0"}, "bake_s", ""),
    ({"engine_args": "{max_model_len: 4096"}, "engine_args", "not JSON"),
    ({"engine_args": "[4096]"}, "engine_args", "JSON object"),
    ({"tensor_parallel": "3"}, "tensor_parallel", "tensor_parallel must be one of"),
    ({"ttft_ratio": "0.5"}, "ttft_ratio", "thresholds.ttft_ratio"),
    ({"max_error_rate": "2"}, "max_error_rate", "thresholds.max_error_rate"),
    ({"waves": "aws:nowhere-1"}, "waves", "waves[0][0]"),
    ({"strategy": "blue_green", "steps": "50, 100"}, "steps", "blue_green"),
    ({"strategy": "canary", "rollback_window_s": "60"}, "rollback_window_s", "blue_green"),
    ({"deployment": "no-such-deployment"}, "deployment", ""),
])
def test_a_wrong_field_is_shown_by_name_and_nothing_is_made(  # type: ignore[no-untyped-def]
        operator, fleet, body, field, says):
    revisions = Revision.objects.count()
    response = post(operator, {"deployment": fleet.acme.name, **body})
    assert response.status_code == 400
    form = response.context["start_form"]
    assert field in form.errors, form.errors
    assert says in " ".join(form.errors[field])
    assert f"{field}: " in response.content.decode()
    assert not Rollout.objects.exists() and Revision.objects.count() == revisions
    assert not AuditLog.objects.filter(action="rollout.started").exists()


def test_a_second_rollout_in_progress_is_refused_saying_why(operator, fleet):  # type: ignore[no-untyped-def]
    assert post(operator, {"deployment": fleet.acme.name}).status_code == 302
    first = Rollout.objects.get()
    response = post(operator, {"deployment": fleet.acme.name})
    assert response.status_code == 409
    assert f"already has rollout {first.pk} in progress" in response.content.decode()
    assert Rollout.objects.count() == 1


@pytest.mark.parametrize("who", ["viewer", "tenant-operator"])
def test_viewers_and_tenant_operators_cannot_start_one(signed_in, fleet, tenants, who):  # type: ignore[no-untyped-def]
    client = (signed_in(Role.VIEWER) if who == "viewer"
              else signed_in(Role.OPERATOR, tenants["acme"]))
    assert 'id="rollout-start"' not in client.get("/rollouts/").content.decode()
    response = client.post("/rollouts/start/", {"deployment": fleet.acme.name,
                                                "strategy": "canary", "bake_s": "60"})
    assert response.status_code == 403
    assert not Rollout.objects.exists()

"""Revisions are immutable; a rollout's state machine through the API (409s, 400s, audit),
and the split it puts into the compiled tables."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import DatabaseError, IntegrityError, transaction

from controlplane.core.models import AuditLog, Role
from controlplane.deployments.models import Deployment, ImmutableError, Replica, Revision
from controlplane.deployments.models import ReplicaState as S
from controlplane.deployments.services import stable_revision
from controlplane.rollouts import analyst
from controlplane.rollouts.models import Rollout, RolloutState
from controlplane.routing import compiler
from controlplane.routing.services import replica_views

pytestmark = pytest.mark.django_db

URL = "/api/v1/rollouts/"


def start(client: Any, target: Deployment, **body: Any) -> Any:
    return client.post(URL, {"deployment": target.name, "bake_s": 60, **body},
                       format="json")


def test_revisions_are_immutable(deployment):  # type: ignore[no-untyped-def]
    revision = stable_revision(deployment)
    assert revision.number == 1 and revision.tensor_parallel == deployment.tensor_parallel
    revision.vllm_version = "0.11.0"
    with pytest.raises(ImmutableError):
        revision.save()
    with pytest.raises(DatabaseError), transaction.atomic():
        Revision.objects.filter(pk=revision.pk).update(vllm_version="0.11.0")
    assert Revision.objects.get(pk=revision.pk).vllm_version == ""


def test_one_rollout_in_progress_per_deployment_in_the_database(deployment):  # type: ignore[no-untyped-def]
    stable = stable_revision(deployment)
    Rollout.objects.create(deployment=deployment, from_revision=stable, to_revision=stable,
                           steps=[100], bake_s=1, state=RolloutState.PAUSED)
    with pytest.raises(IntegrityError), transaction.atomic():
        Rollout.objects.create(deployment=deployment, from_revision=stable,
                               to_revision=stable, steps=[100], bake_s=1)
    # finished ones do not count
    Rollout.objects.create(deployment=deployment, from_revision=stable, to_revision=stable,
                           steps=[100], bake_s=1, state=RolloutState.ROLLED_BACK)


@pytest.mark.parametrize(("body", "field"), [
    ({"steps": [5, 5, 100]}, "steps"),
    ({"steps": [50, 25, 100]}, "steps"),
    ({"steps": [5, 25, 50]}, "steps"),
    ({"steps": [0, 100]}, "steps"),
    ({"steps": []}, "steps"),
    ({"steps": "5,100"}, "steps"),
    ({"bake_s": 0}, "bake_s"),
    ({"bake_s": -5}, "bake_s"),
    ({"tensor_parallel": 0}, "tensor_parallel"),
    ({"deployment": "nope"}, "deployment"),
    ({"thresholds": [1.2]}, "thresholds"),
    ({"thresholds": {"ttft_ratio": 0.9}}, "thresholds.ttft_ratio"),
    ({"thresholds": {"itl_ratio": "1.5"}}, "thresholds.itl_ratio"),
    ({"thresholds": {"error_points": -1}}, "thresholds.error_points"),
    ({"thresholds": {"max_error_rate": 1.5}}, "thresholds.max_error_rate"),
    ({"thresholds": {"max_ttft_p95_s": 0}}, "thresholds.max_ttft_p95_s"),
    ({"thresholds": {"min_requests": 2.5}}, "thresholds.min_requests"),
    ({"thresholds": {"max_extensions": True}}, "thresholds.max_extensions"),
    ({"thresholds": {"ttft_p99": 2}}, "thresholds.ttft_p99"),
    ({"strategy": "rainbow"}, "strategy"),
    ({"strategy": "blue_green", "steps": [50, 100]}, "steps"),
    ({"strategy": "blue_green", "rollback_window_s": 0}, "rollback_window_s"),
    ({"strategy": "blue_green", "rollback_window_s": "600"}, "rollback_window_s"),
    ({"rollback_window_s": 60}, "rollback_window_s"),  # a canary has no window
    ({"auto_promote": "yes"}, "auto_promote"),
    ({"auto_promote": 1}, "auto_promote"),
])
def test_bad_input_is_400_naming_the_field(deployment, operator, body, field):  # type: ignore[no-untyped-def]
    response = start(operator, deployment, **body)
    assert response.status_code == 400, response.content
    assert field in response.json()
    if field.startswith("thresholds."):
        assert field.split(".")[1] in response.json()[field][0]
    assert not Rollout.objects.exists()
    assert Revision.objects.filter(deployment=deployment).count() <= 1


def test_state_machine_through_the_api(deployment, operator, make_client):  # type: ignore[no-untyped-def]
    assert start(make_client(Role.VIEWER), deployment).status_code == 403
    response = start(operator, deployment, steps=[10, 50, 100], vllm_version="0.11.0",
                     engine_args={"max_model_len": 4096})
    assert response.status_code == 201, response.content
    body = response.json()
    rid = body["id"]
    assert body["state"] == "running" and body["weight"] == 10 and body["current_step"] == 0
    # Thresholds default, the absolute TTFT limit to the deployment's SLO.
    assert body["thresholds"] == {
        "ttft_ratio": 1.2, "itl_ratio": 1.2, "error_points": 1.0,
        "max_ttft_p95_s": deployment.slo_ttft_p95_ms / 1000, "max_error_rate": 0.05,
        "min_requests": 20, "max_extensions": 3}
    assert body["from_revision"]["number"] == 1 and body["to_revision"]["number"] == 2
    assert body["to_revision"]["engine_args"]["max_model_len"] == 4096
    assert body["to_revision"]["vllm_version"] == "0.11.0"
    assert [s["weight"] for s in body["step_rows"]] == [10]
    deployment.refresh_from_db()
    assert deployment.canary_weight == 0  # until its replica serves
    assert deployment.canary_revision_id == body["to_revision"]["id"]
    canary = Replica.objects.get(revision_id=body["to_revision"]["id"])
    # Placed by the solver, within the deployment's jurisdictions.
    assert canary.state == S.PENDING and canary.region.jurisdiction.code == "EU"
    Replica.objects.filter(pk=canary.pk).update(state=S.READY, url="http://10.0.0.2:8000")
    assert analyst.check() == {str(rid): "live"}
    deployment.refresh_from_db()
    assert deployment.canary_weight == 10
    assert operator.get(f"{URL}{rid}/").json()["step_rows"][0]["ready_at"]

    # A second rollout while one is in progress: 409, naming the one in progress.
    again = start(operator, deployment)
    assert again.status_code == 409 and str(rid) in again.json()["detail"]

    def act(name: str) -> Any:
        return operator.post(f"{URL}{rid}/{name}/", {"reason": "test"}, format="json")

    assert act("resume").status_code == 409  # running, not paused
    paused = act("pause")
    assert paused.status_code == 200 and paused.json()["state"] == "paused"
    refused = act("pause")
    assert refused.status_code == 409 and "paused" in refused.json()["detail"]
    assert act("advance").status_code == 409  # paused
    assert act("resume").json()["state"] == "running"
    advanced = act("advance").json()
    assert advanced["weight"] == 50 and advanced["current_step"] == 1
    assert [s["decision"] for s in advanced["step_rows"]] == ["advanced", ""]
    assert act("advance").json()["weight"] == 100
    last = act("advance")
    assert last.status_code == 409 and "last step" in last.json()["detail"]
    promoted = act("promote").json()
    assert promoted["state"] == "promoted" and promoted["ended_at"]
    deployment.refresh_from_db()
    assert deployment.stable_revision_id == body["to_revision"]["id"]
    assert deployment.canary_revision_id is None and deployment.canary_weight == 0
    assert deployment.max_model_len == 4096
    for name in ("pause", "resume", "advance", "promote", "rollback"):
        response = act(name)
        assert response.status_code == 409, name
        assert "promoted" in response.json()["detail"]
    actions = list(AuditLog.objects.filter(action__startswith="rollout.")
                   .order_by("id").values_list("action", flat=True))
    assert actions == ["rollout.started", "rollout.paused", "rollout.resumed",
                       "rollout.advanced", "rollout.advanced", "rollout.promoted"]


def test_given_thresholds_are_kept_over_the_defaults(deployment, operator):  # type: ignore[no-untyped-def]
    body = start(operator, deployment, thresholds={"ttft_ratio": 1.5, "min_requests": 5}).json()
    assert body["thresholds"]["ttft_ratio"] == 1.5 and body["thresholds"]["min_requests"] == 5
    assert body["thresholds"]["itl_ratio"] == 1.2


def test_rollback_sets_weight_zero_and_retires_canaries(deployment, operator):  # type: ignore[no-untyped-def]
    body = start(operator, deployment).json()
    canary = Replica.objects.get(revision_id=body["to_revision"]["id"])
    Replica.objects.filter(pk=canary.pk).update(state=S.READY, url="http://10.0.0.2:8000")
    response = operator.post(f"{URL}{body['id']}/rollback/", {"reason": "bad ttft"},
                             format="json")
    assert response.status_code == 200, response.content
    assert response.json()["state"] == "rolled_back"
    assert response.json()["reason"] == "bad ttft"
    deployment.refresh_from_db()
    assert deployment.canary_weight == 0 and deployment.canary_revision_id is None
    assert deployment.stable_revision_id == body["from_revision"]["id"]
    assert Replica.objects.get(pk=canary.pk).state == S.DRAINING
    event = AuditLog.objects.get(action="rollout.rolled_back")
    assert event.changes["retired"] == [canary.public_id]
    assert operator.post(f"{URL}{body['id']}/rollback/").status_code == 409
    # The deployment may start a new rollout now.
    assert start(operator, deployment).status_code == 201


def compiled(catalog) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    fra = catalog["fra"]
    edge = compiler.EdgeView("edge-eu", fra.key, fra.latitude, fra.longitude)
    policy = compiler.PolicyView(scorers={"load": 1.0}, retry_before_first_byte=1,
                                 eject_after_failures=2, eject_base_s=1.0)
    return compiler.compile_table(edge, replica_views(), [], policy, version=1,
                                  issued_at="2026-11-27T12:00:00+00:00", key_id="k")


def test_the_compiled_table_carries_revision_weights(deployment, operator, catalog):  # type: ignore[no-untyped-def]
    before = compiled(catalog)["models"]["llama-3.1-8b"]
    assert "revisions" not in before and "revision" not in before["replicas"][0]
    body = start(operator, deployment, steps=[5, 25, 100]).json()
    stable, canary = str(body["from_revision"]["id"]), str(body["to_revision"]["id"])
    replica = Replica.objects.get(revision_id=canary)
    Replica.objects.filter(pk=replica.pk).update(state=S.READY, url="http://10.0.0.2:8000")
    model = compiled(catalog)["models"]["llama-3.1-8b"]
    assert model["revisions"] == {stable: 100.0, canary: 0.0}  # listed, no share yet
    analyst.check()
    model = compiled(catalog)["models"]["llama-3.1-8b"]
    assert model["revisions"] == {stable: 95.0, canary: 5.0}
    assert {r["id"]: r["revision"] for r in model["replicas"]} == {
        r.public_id: str(r.revision_id or stable) for r in Replica.objects.all()}
    operator.post(f"{URL}{body['id']}/advance/")
    assert compiled(catalog)["models"]["llama-3.1-8b"]["revisions"] == {stable: 75.0,
                                                                         canary: 25.0}
    # The edge accepts what the control plane compiles.
    from edge.table import parse_table
    table = parse_table(compiled(catalog))
    assert dict(table.revisions["llama-3.1-8b"]) == {stable: 75.0, canary: 25.0}
    assert table.revisions["llama-3.1-8b"][0][0] == canary  # the newest revision first


def test_a_canary_replica_launches_with_its_revisions_settings(deployment, operator):  # type: ignore[no-untyped-def]
    from controlplane.provisioning.services import spec_for

    body = start(operator, deployment, engine_args={"max_model_len": 4096,
                                                    "enable_prefix_caching": False}).json()
    canary = Replica.objects.get(revision_id=body["to_revision"]["id"])
    stable = Replica.objects.exclude(pk=canary.pk).get()
    assert (spec_for(canary).max_model_len, spec_for(canary).enable_prefix_caching) == (
        4096, False)
    assert (spec_for(stable).max_model_len, spec_for(stable).enable_prefix_caching) == (
        deployment.max_model_len, deployment.enable_prefix_caching)

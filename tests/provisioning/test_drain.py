"""Draining: a replica is terminated as soon as its engine has nothing in flight, or at the
deadline; never while requests run before it."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.utils import timezone

from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.provisioning import services
from controlplane.scaling.services import DRAIN_DEADLINE_S, DRAIN_GRACE_S, drain_replica

pytestmark = pytest.mark.django_db


@pytest.fixture
def engine():  # type: ignore[no-untyped-def]
    """/metrics in vLLM's names, with the running and waiting counts a test sets."""
    load = {"running": 0, "waiting": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = (f'vllm:num_requests_running{{engine="0",model_name="m"}} {load["running"]}\n'
                    f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {load["waiting"]}\n')
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield load, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def draining(catalog, engine):  # type: ignore[no-untyped-def]
    deployment = Deployment.objects.create(name="d", served_model_name="m", model=catalog["llama8b"])
    return Replica.objects.create(deployment=deployment, region=catalog["fra"], url=engine[1],
                                  state=S.DRAINING, state_changed_at=timezone.now())


def test_in_flight_requests_keep_the_replica_until_they_finish(engine, draining):  # type: ignore[no-untyped-def]
    load, _ = engine
    load["running"], load["waiting"] = 2, 1
    assert services.finish_drain(draining.pk, "scale down", DRAIN_DEADLINE_S) == "waiting"
    assert Replica.objects.get(pk=draining.pk).state == S.DRAINING
    load["running"] = load["waiting"] = 0
    assert services.finish_drain(draining.pk, "scale down", DRAIN_DEADLINE_S) == "terminated"
    replica = Replica.objects.get(pk=draining.pk)
    assert replica.state == S.TERMINATED


def test_past_the_deadline_or_unreadable_it_is_left_to_the_deadline_task(engine, draining):  # type: ignore[no-untyped-def]
    load, _ = engine
    load["running"] = 5
    assert services.finish_drain(draining.pk, "x", deadline_s=0) == "left"
    Replica.objects.filter(pk=draining.pk).update(url="http://127.0.0.1:9")
    assert services.finish_drain(draining.pk, "x", DRAIN_DEADLINE_S) == "left"
    assert Replica.objects.get(pk=draining.pk).state == S.DRAINING


def test_a_drain_schedules_the_early_check_and_the_deadline(catalog, sent_tasks,  # type: ignore[no-untyped-def]
                                                           django_capture_on_commit_callbacks):
    deployment = Deployment.objects.create(name="d", served_model_name="m", model=catalog["llama8b"])
    replica = Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY)
    with django_capture_on_commit_callbacks(execute=True):
        drain_replica(replica, actor="ops", reason="maintenance")
    assert ("provisioning.finish_drain", (replica.pk, "maintenance", DRAIN_DEADLINE_S),
            {"countdown": DRAIN_GRACE_S}) in sent_tasks
    assert ("provisioning.terminate_replica", (replica.pk, "maintenance"),
            {"countdown": DRAIN_DEADLINE_S}) in sent_tasks

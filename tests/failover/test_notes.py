"""An incident's notes come from its own record: a stage's note is stamped with the stage's
stored time and gives the timeline's figure, and notes name replicas (r-2), not ports."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from controlplane.deployments.models import Replica
from controlplane.failover import services
from controlplane.failover.models import Incident
from controlplane.failover.notes import failures, scrub
from controlplane.failover.timeline import timeline

from .conftest import dead_url, fail_one_and_ready_its_replacement

REFUSED = ("/health failed: ClientConnectorError: Cannot connect to host 127.0.0.1:{port} "
           "ssl:default [Connect call failed ('127.0.0.1', {port})]")


def test_an_error_names_the_replica_where_it_named_its_address() -> None:
    error = REFUSED.format(port=8102)
    said = scrub(error, "https://127.0.0.1:8102", "r-2")
    assert "8102" not in said and "127.0.0.1" not in said
    assert said.count("r-2") == 2


def test_two_replicas_failing_alike_are_named_both_and_no_port_is() -> None:
    said = failures([("r-2", "http://127.0.0.1:8102", REFUSED.format(port=8102)),
                     ("r-5", "http://127.0.0.1:8105", REFUSED.format(port=8105))])
    assert said.startswith("r-2, r-5: /health failed")
    assert "8102" not in said and "8105" not in said
    different = failures([("r-2", "http://127.0.0.1:8102", REFUSED.format(port=8102)),
                          ("r-5", "http://127.0.0.1:8105", "/health answered 500")])
    assert different == ("r-2: /health failed: ClientConnectorError: Cannot connect to host r-2 "
                         "ssl:default [Connect call failed r-2]; r-5: /health answered 500")


@pytest.mark.django_db
def test_a_detection_note_names_each_failed_replica_and_no_port(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, sent_tasks):
    lost = [ready_replica(deployment, catalog["fra"], dead_url()) for _ in range(2)]
    services.watch()
    (detected,) = [text for _, text in Incident.objects.get().notes if text.startswith("detected")]
    for replica in lost:
        assert replica.public_id in detected.split(" failed:")[1], detected
        port = replica.url.rsplit(":", 1)[1].strip("/")
        assert port not in detected, detected


@pytest.mark.django_db
def test_a_stage_note_is_the_stages_stored_time_and_figure(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks):
    new = fail_one_and_ready_its_replacement(deployment, catalog["fra"], ready_replica, engines)
    # The replacement was ready a while before the watch loop noticed.
    assert new.ready_at is not None
    Replica.objects.filter(pk=new.pk).update(ready_at=new.ready_at - timedelta(seconds=0.853))
    services.watch()
    incident = Incident.objects.get()
    (at, text), = [(at, text) for at, text in incident.notes
                   if text.startswith("replacements ready")]
    assert incident.replacement_ready_at is not None
    assert datetime.fromisoformat(at) == incident.replacement_ready_at
    seconds = timeline(incident)["replacement_ready_s"]
    assert text == f"replacements ready at +{seconds:.3f} s"
    stamps = [datetime.fromisoformat(at) for at, _ in incident.notes]
    assert stamps == sorted(stamps)

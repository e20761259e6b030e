"""Webhook notifications to a real local HTTP server: the JSON sent on open and resolve,
retries on failure by the Celery task, giving up, timeouts, and a bad URL."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from controlplane.alerts import services, tasks, webhook
from controlplane.alerts.models import Alert, AlertDelivery, NotifyState
from controlplane.core.models import AuditLog
from controlplane.failover.models import RegionHealth

pytestmark = pytest.mark.django_db


def _region(catalog: dict[str, Any], state: str) -> None:
    now = timezone.now()
    RegionHealth.objects.update_or_create(
        region=catalog["fra"], defaults={"state": state, "reason": "test", "changed_at": now,
                                         "checked_at": now})


def test_opened_and_resolved_are_posted_as_json(catalog, receiver, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(settings.MERIDIAN, "ALERT_WEBHOOK_URL", receiver.url)
    _region(catalog, "down")
    report = services.evaluate()
    assert receiver.received == []  # evaluation only queues: nothing was posted meanwhile
    alert = Alert.objects.get()
    assert alert.notify_state == NotifyState.PENDING
    [delivery_id] = report.deliveries

    result = tasks.deliver_webhook.apply(args=[delivery_id]).get()
    assert result == {"sent": 1, "attempts": 1}
    [body] = receiver.received
    assert receiver.headers[0]["Content-Type"] == "application/json"
    assert body["event"] == "opened"
    assert body["alert"]["id"] == alert.pk and body["alert"]["rule"] == "region_down"
    assert body["alert"]["subject"] == "aws:eu-central-1"
    assert body["alert"]["severity"] == "critical" and body["alert"]["state"] == "open"
    assert body["alert"]["resolved_at"] is None
    delivery = AlertDelivery.objects.get(pk=delivery_id)
    assert (delivery.state, delivery.attempts, delivery.response_status) == ("sent", 1, 200)
    assert delivery.delivered_at is not None
    assert Alert.objects.get().notify_state == NotifyState.SENT

    _region(catalog, "healthy")
    report = services.evaluate(now=timezone.now() + timedelta(seconds=10))
    assert Alert.objects.get().notify_state == NotifyState.PENDING
    tasks.deliver_webhook.apply(args=[report.deliveries[0]])
    assert [b["event"] for b in receiver.received] == ["opened", "resolved"]
    resolved = receiver.received[1]["alert"]
    assert resolved["state"] == "resolved" and resolved["resolved_at"] is not None
    assert Alert.objects.get().notify_state == NotifyState.SENT


def test_failed_posts_are_retried_by_the_task(catalog, receiver, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(settings.MERIDIAN, "ALERT_WEBHOOK_URL", receiver.url)
    receiver.statuses = [500, 502, 200]
    _region(catalog, "down")
    [delivery_id] = services.evaluate().deliveries
    assert tasks.deliver_webhook.apply(args=[delivery_id]).get() == {"sent": 1, "attempts": 3}
    assert len(receiver.received) == 3
    delivery = AlertDelivery.objects.get(pk=delivery_id)
    assert (delivery.state, delivery.attempts, delivery.last_error) == ("sent", 3, "")
    # A delivery already sent is not sent again (a duplicate task is harmless).
    tasks.deliver_webhook.apply(args=[delivery_id])
    assert len(receiver.received) == 3


def test_the_task_gives_up_after_its_retries(catalog, receiver, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(settings.MERIDIAN, "ALERT_WEBHOOK_URL", receiver.url)
    monkeypatch.setattr(tasks.deliver_webhook, "max_retries", 2)
    receiver.statuses = [503]
    _region(catalog, "down")
    [delivery_id] = services.evaluate().deliveries
    assert tasks.deliver_webhook.apply(args=[delivery_id]).get() == {"sent": 0, "attempts": 3}
    assert len(receiver.received) == 3
    delivery = AlertDelivery.objects.get(pk=delivery_id)
    assert (delivery.state, delivery.attempts, delivery.response_status) == ("failed", 3, 503)
    assert delivery.last_error == "the webhook answered HTTP 503"
    assert Alert.objects.get().notify_state == NotifyState.FAILED


def test_a_slow_receiver_times_out(catalog, receiver, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(settings.MERIDIAN, "ALERT_WEBHOOK_URL", receiver.url)
    monkeypatch.setitem(settings.MERIDIAN, "ALERT_WEBHOOK_TIMEOUT_S", 0.2)
    receiver.hold = True  # answers only when the test ends: the timeout must end the wait
    _region(catalog, "down")
    [delivery_id] = services.evaluate().deliveries
    assert webhook.deliver(delivery_id) is False
    delivery = AlertDelivery.objects.get(pk=delivery_id)
    assert delivery.state == "pending" and delivery.attempts == 1
    assert "timed out" in delivery.last_error


def test_an_unreachable_receiver_is_recorded(catalog, monkeypatch):  # type: ignore[no-untyped-def]
    from controlplane.provisioning.local import free_port

    monkeypatch.setitem(settings.MERIDIAN, "ALERT_WEBHOOK_URL", f"http://127.0.0.1:{free_port()}/hook")
    _region(catalog, "down")
    [delivery_id] = services.evaluate().deliveries
    assert webhook.deliver(delivery_id) is False
    assert "Connection refused" in AlertDelivery.objects.get(pk=delivery_id).last_error


def test_the_evaluate_task_enqueues_deliveries(catalog, receiver, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(settings.MERIDIAN, "ALERT_WEBHOOK_URL", receiver.url)
    queued: list[int] = []
    monkeypatch.setattr(tasks.deliver_webhook, "delay", queued.append)
    _region(catalog, "down")
    assert tasks.evaluate.apply().get()["deliveries"] == 1
    assert queued == list(AlertDelivery.objects.values_list("pk", flat=True))


def test_an_escalation_to_critical_is_sent_again_and_clears_the_acknowledgement(  # type: ignore[no-untyped-def]
        catalog, receiver, monkeypatch):
    monkeypatch.setitem(settings.MERIDIAN, "ALERT_WEBHOOK_URL", receiver.url)
    t0 = timezone.now()
    _region(catalog, "degraded")
    [opened] = services.evaluate(now=t0).deliveries
    tasks.deliver_webhook.apply(args=[opened])
    alert = Alert.objects.get()
    assert alert.severity == "warning"
    services.acknowledge(alert.pk, "ops@example.com", "looking")

    _region(catalog, "down")
    report = services.evaluate(now=t0 + timedelta(seconds=10))
    assert report.escalated == [alert.pk] and report.opened == []
    [escalated] = report.deliveries
    alert = Alert.objects.get()
    assert (alert.severity, alert.acknowledged_at, alert.acknowledged_by) == ("critical", None, "")
    assert alert.notify_state == NotifyState.PENDING
    tasks.deliver_webhook.apply(args=[escalated])
    assert [b["event"] for b in receiver.received] == ["opened", "escalated"]
    assert receiver.received[1]["alert"]["severity"] == "critical"
    assert receiver.received[1]["alert"]["id"] == alert.pk

    assert alert.escalated_at == t0 + timedelta(seconds=10)

    # Still critical: nothing new. Back to warning: updated, not sent. Critical again (a
    # value swinging around the threshold): updated, not sent, acknowledgement kept.
    assert services.evaluate(now=t0 + timedelta(seconds=20)).deliveries == []
    _region(catalog, "degraded")
    report = services.evaluate(now=t0 + timedelta(seconds=30))
    assert (report.deliveries, report.escalated) == ([], [])
    assert Alert.objects.get().severity == "warning"
    services.acknowledge(alert.pk, "ops@example.com", "on it")
    _region(catalog, "down")
    report = services.evaluate(now=t0 + timedelta(seconds=40))
    assert (report.deliveries, report.escalated) == ([], [])
    alert = Alert.objects.get()
    assert alert.severity == "critical" and alert.acknowledged_by == "ops@example.com"
    actions = list(AuditLog.objects.filter(object_type="alerts.alert").order_by("pk")
                   .values_list("action", flat=True))
    assert actions == ["alert.opened", "alert.acknowledged", "alert.escalated",
                       "alert.acknowledged"]

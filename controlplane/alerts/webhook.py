"""The alert webhook (`MERIDIAN_ALERT_WEBHOOK_URL`): one delivery row per opening,
escalation and resolution, queued by the evaluation and POSTed by the
`alerts.deliver_webhook` task, which retries it and gives up after its last try."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from controlplane.alerts.models import Alert, AlertDelivery, NotifyState


def webhook_url() -> str | None:
    """MERIDIAN_ALERT_WEBHOOK_URL, checked at start-up; None when unset."""
    return settings.MERIDIAN["ALERT_WEBHOOK_URL"]


def webhook_timeout_s() -> float:
    return settings.MERIDIAN["ALERT_WEBHOOK_TIMEOUT_S"]


def payload(alert: Alert, event: str, now: datetime) -> dict[str, Any]:
    return {
        "event": event,
        "sent_by": "meridian",
        "alert": {
            "id": alert.pk, "rule": alert.rule, "subject": alert.subject,
            "tenant": alert.tenant.name if alert.tenant_id and alert.tenant else None,
            "severity": alert.severity, "state": alert.state, "message": alert.message,
            "value": alert.value, "threshold": alert.threshold, "unit": alert.unit,
            "firing_since": _iso(alert.firing_since), "opened_at": _iso(alert.opened_at),
            "resolved_at": _iso(alert.resolved_at),
        },
        "at": _iso(now),
    }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def queue_delivery(alert: Alert, event: str, url: str, now: datetime) -> int:
    delivery = AlertDelivery.objects.create(
        alert=alert, event=event, url=url, payload=payload(alert, event, now), created_at=now)
    return delivery.pk


def deliver(delivery_id: int, timeout_s: float | None = None) -> bool:
    """POST one delivery's JSON body; records the attempt. True once it is delivered (2xx)."""
    delivery = AlertDelivery.objects.filter(pk=delivery_id).first()
    if delivery is None or delivery.state == NotifyState.SENT:
        return True  # gone with its alert, or sent by an earlier attempt
    timeout_s = timeout_s if timeout_s is not None else webhook_timeout_s()
    body = json.dumps(delivery.payload).encode()
    request = urllib.request.Request(
        delivery.url, data=body, method="POST",
        headers={"Content-Type": "application/json", "User-Agent": "meridian-alerts/1"})
    status, error = None, ""
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            status = response.status
    except urllib.error.HTTPError as exc:
        status, error = exc.code, f"the webhook answered HTTP {exc.code}"
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        error = f"{type(reason).__name__}: {reason}"[:300]
    sent = status is not None and 200 <= status < 300
    now = timezone.now()
    AlertDelivery.objects.filter(pk=delivery.pk).update(
        attempts=F("attempts") + 1, last_attempt_at=now, response_status=status,
        last_error="" if sent else error, state=NotifyState.SENT if sent else NotifyState.PENDING,
        delivered_at=now if sent else None)
    if sent:
        _set_notify_state(delivery, NotifyState.SENT)
    return sent


def give_up(delivery_id: int) -> None:
    """After the last retry: the delivery failed."""
    delivery = AlertDelivery.objects.filter(pk=delivery_id).first()
    if delivery is None or delivery.state == NotifyState.SENT:
        return
    AlertDelivery.objects.filter(pk=delivery.pk).update(state=NotifyState.FAILED)
    _set_notify_state(delivery, NotifyState.FAILED)


def _set_notify_state(delivery: AlertDelivery, state: str) -> None:
    """The alert shows its newest delivery's state; an older one finishing late does not."""
    newest = AlertDelivery.objects.filter(alert_id=delivery.alert_id).order_by(
        "-created_at", "-id").values_list("pk", flat=True).first()
    if newest == delivery.pk:
        Alert.objects.filter(pk=delivery.alert_id).update(notify_state=state)


def undelivered(older_than: timedelta = timedelta(minutes=10)) -> list[int]:
    """Deliveries still pending long after they were queued with no attempt (a lost task)."""
    cutoff = timezone.now() - older_than
    return list(AlertDelivery.objects.filter(
        state=NotifyState.PENDING, attempts=0, created_at__lt=cutoff).values_list("pk", flat=True))

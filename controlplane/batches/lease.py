"""How long a worker's claim on a line lasts. A running line whose claim is older than the
lease belongs to a worker that died: it is pending work, claimed again by the next runner
(`runner.claim`) and counted as waiting, not running (`progress`)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Q

from controlplane.batches.config import number
from controlplane.batches.models import LineState


def lease() -> timedelta:
    """BATCH_LEASE_S: how long a claim holds a line (600 s)."""
    return timedelta(seconds=number("BATCH_LEASE_S", 600))


def held(now: datetime) -> Q:
    """Running lines a live worker holds at `now`."""
    return Q(state=LineState.RUNNING, claimed_at__gte=now - lease())


def abandoned(now: datetime) -> Q:
    """Running lines whose claim ran out by `now`: their worker died."""
    return Q(state=LineState.RUNNING, claimed_at__lt=now - lease())

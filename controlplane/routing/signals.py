"""Schedules a table push after any commit that changes what edges route on.

Many changes in a burst (a plan applying ten replicas) become one push: the first change
sets a short-lived Redis flag and enqueues the task with a small delay; later changes find
the flag set and do nothing. The task clears the flag before compiling, so a change that
lands while it runs schedules the next push.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save

from controlplane.core.models import ApiKey, Tenant
from controlplane.core.redis_clients import redis_client
from controlplane.deployments.lifecycle import state_changed
from controlplane.deployments.models import Deployment, Replica
from controlplane.routing.models import Edge, RoutingPolicy
from controlplane.routing.tasks import DEBOUNCE_S, PENDING_KEY, publish_tables

log = logging.getLogger(__name__)


def request_publish(**_: Any) -> None:
    transaction.on_commit(_enqueue_publish)


def _enqueue_publish() -> None:
    try:
        if redis_client().set(PENDING_KEY, "1", nx=True, px=int(DEBOUNCE_S * 4000)):
            publish_tables.apply_async(countdown=DEBOUNCE_S)
    except Exception:  # the periodic drift check pushes later if the broker is down now
        log.exception("could not schedule a routing table push")


def _connect() -> None:
    state_changed.connect(request_publish, sender=Replica, dispatch_uid="routing-replica-state")

    for model in (Replica, ApiKey, Tenant, Deployment, Edge, RoutingPolicy):
        post_save.connect(request_publish, sender=model, dispatch_uid=f"routing-save-{model.__name__}")
        post_delete.connect(request_publish, sender=model, dispatch_uid=f"routing-del-{model.__name__}")
    for through in (Tenant.allowed_jurisdictions.through, Tenant.allowed_regions.through,
                    RoutingPolicy.fail_open_tenants.through):
        m2m_changed.connect(request_publish, sender=through, dispatch_uid=f"routing-m2m-{through.__name__}")


_connect()

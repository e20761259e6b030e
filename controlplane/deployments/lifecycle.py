"""The replica state machine (DESIGN §6): the one place a replica's state changes.

    pending → provisioning → starting → ready ⇄ degraded → draining → terminated
    failed from any live state; failed → terminated once its resources are gone.

Each transition is a conditional UPDATE on the current state, so two workers racing on one
replica cannot both move it, and each writes an audit event with its reason.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.dispatch import Signal
from django.utils import timezone

from controlplane.core.services import record_audit
from controlplane.deployments.models import LIVE_STATES as LIVE_STATES
from controlplane.deployments.models import STAYING_STATES as STAYING_STATES
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S

TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.PROVISIONING, S.FAILED, S.TERMINATED}),
    S.PROVISIONING: frozenset({S.STARTING, S.FAILED, S.TERMINATED}),
    S.STARTING: frozenset({S.READY, S.FAILED, S.TERMINATED}),
    S.READY: frozenset({S.DEGRADED, S.DRAINING, S.FAILED}),
    S.DEGRADED: frozenset({S.READY, S.DRAINING, S.FAILED}),
    S.DRAINING: frozenset({S.TERMINATED, S.FAILED}),
    S.FAILED: frozenset({S.TERMINATED}),
    S.TERMINATED: frozenset(),
}
# Sent after every transition (the UPDATE bypasses post_save); routing listens to push tables.
state_changed = Signal()

SERVING_STATES = frozenset({S.READY, S.DEGRADED})


class IllegalTransition(Exception):
    """A state change the machine does not allow, or one that lost a race."""

    def __init__(self, replica_id: int, current: str, wanted: str) -> None:
        self.replica_id, self.current, self.wanted = replica_id, current, wanted
        super().__init__(f"replica r-{replica_id} cannot go from {current} to {wanted}")


@transaction.atomic
def transition(
    replica: Replica | int, to: str, *, actor: str, reason: str, **fields: Any
) -> Replica:
    """Move a replica to `to` if the machine allows it from its current state.

    Extra `fields` (url, provider_handle, last_error …) are written in the same UPDATE.
    Raises IllegalTransition when the move is not allowed or another worker moved it first.
    """
    replica_id = replica if isinstance(replica, int) else replica.pk
    now = timezone.now()
    values: dict[str, Any] = {"state": to, "state_changed_at": now, **fields}
    if to == S.READY:
        values.setdefault("ready_at", now)
    if to == S.TERMINATED:
        values.setdefault("terminated_at", now)
    current = Replica.objects.filter(pk=replica_id).values_list("state", flat=True).first()
    if current is None:
        raise Replica.DoesNotExist(f"replica r-{replica_id} does not exist")
    if to not in TRANSITIONS[current]:
        raise IllegalTransition(replica_id, current, to)
    moved = Replica.objects.filter(pk=replica_id, state=current).update(**values)
    if moved != 1:
        now_state = Replica.objects.filter(pk=replica_id).values_list("state", flat=True).first()
        raise IllegalTransition(replica_id, str(now_state), to)
    updated = Replica.objects.select_related("deployment", "region__cloud").get(pk=replica_id)
    record_audit(
        actor, f"replica.{to}", updated,
        changes={"from": current, "to": to, **{k: _plain(v) for k, v in fields.items()}},
        reason=reason,
    )
    state_changed.send(sender=Replica, replica=updated, before=current, after=to)
    return updated


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, dict, list)) or value is None else str(value)

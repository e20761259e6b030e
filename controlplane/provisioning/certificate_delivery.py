"""Renewed server certificates reach the nodes that serve them.

`core.renew_certificates` renews a replica's certificate in its directory on the control
plane. A provider whose engines read that directory themselves (local processes) needs
nothing more; one whose nodes hold a copy (SkyPilot: `Capabilities.delivers_certificates`)
gets each new certificate sent by `deliver_renewed`, every few minutes:

- a node whose handle records an older serial (or none) is sent the current one; the
  handle records it with the job that writes it (`tls: {serial, job}`);
- that job is followed on the next rounds: once it has succeeded the serial counts as
  delivered (`job` cleared); if it failed, or the send itself failed, it is sent again.

A replica whose node never gets its renewed certificate stops answering edges when the old
one expires; health checks then fail it and failover replaces it.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from controlplane.core import certificates
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.provisioning.base import ProviderError
from controlplane.provisioning.services import get_provider, handle_of
from controlplane.provisioning.skypilot_certificates import JOB_DONE, JOB_PENDING

log = logging.getLogger("meridian.provisioning.certificates")

# States in which the replica's node is up and its engine reads its certificate.
NODE_STATES = (S.STARTING, S.READY, S.DEGRADED, S.DRAINING)


def delivered(replica: Replica) -> dict[str, Any]:
    """What the handle records of the certificate on the node: {serial, job}, or {}."""
    return dict((replica.provider_handle or {}).get("tls") or {})


def record_delivery(replica_id: int, serial: str, job: str | None) -> None:
    """Write the handle's `tls` record, reading the handle again under a row lock so that a
    concurrent change to the rest of it is kept."""
    with transaction.atomic():
        row = Replica.objects.select_for_update().get(pk=replica_id)
        handle = dict(row.provider_handle or {})
        handle["tls"] = {"serial": serial, "job": job}
        Replica.objects.filter(pk=replica_id).update(provider_handle=handle)


def _deliver_one(replica: Replica, provider: Any) -> str:
    """One replica's round: "sent", "confirmed", "pending", "current" or "failed"."""
    row = certificates.current(f"replica:{replica.public_id}")
    handle = handle_of(replica)
    if row is None or handle is None or not row.install_dir:
        return "current"  # no certificate of its own (plain HTTP) or no node yet
    record = delivered(replica)
    if record.get("serial") == row.serial and record.get("job") is None:
        return "current"
    if record.get("serial") == row.serial:
        state = provider.certificate_job_state(handle, str(record["job"]))
        if state == JOB_DONE:
            record_delivery(replica.pk, row.serial, None)
            return "confirmed"
        if state == JOB_PENDING:
            return "pending"
        log.warning("certificate %s did not reach %s: its job %s failed; sending again",
                    row.serial, replica.public_id, record["job"])
    job = provider.deliver_certificate(handle, row.install_dir)
    record_delivery(replica.pk, row.serial, job)
    return "sent"


def deliver_renewed() -> dict[str, list[str]]:
    """Send every node-holding replica whose provider keeps copies its current certificate,
    and follow the jobs already sent; returns replica ids by outcome."""
    outcome: dict[str, list[str]] = {"sent": [], "confirmed": [], "pending": [], "failed": []}
    replicas = Replica.objects.filter(state__in=NODE_STATES).order_by("pk")
    providers = {name: get_provider(name)
                 for name in set(replicas.values_list("provider", flat=True))}
    for replica in replicas:
        provider = providers[replica.provider]
        if not provider.capabilities.delivers_certificates:
            continue
        try:
            result = _deliver_one(replica, provider)
        except ProviderError as exc:
            log.warning("certificate for %s not delivered: %s", replica.public_id, exc)
            result = "failed"
        if result in outcome:
            outcome[result].append(replica.public_id)
    return outcome


"""Whether the engines the lab started are ready, and the line that says so.

A replica is ready once the provision worker's check has moved it to ready (or degraded):
the provider reports its process running and the engine answers /health and lists the
served model (`provisioning.services.check`), the same evidence that puts it in routing
tables. The lab waits on those rows, printing which replicas it still waits for, and says
"Meridian lab is up." only once every one is ready; a wait that runs out, or a replica that
fails, is named instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from controlplane.deployments.lifecycle import SERVING_STATES
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.lab.waiting import WaitTimeout, wait_until

LAUNCHING_STATES = frozenset({S.PENDING, S.PROVISIONING, S.STARTING})
UP = "Meridian lab is up."
# How often the waiting line is repeated while nothing changes.
REMIND_S = 15.0


@dataclass(frozen=True)
class EngineReport:
    """The lab's engines, each as `r-N (cloud:region)`."""

    ready: tuple[str, ...] = ()
    starting: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()  # failed, or stopped before it was ready

    @property
    def all_ready(self) -> bool:
        return not self.starting and not self.failed


def engine_report(replica_ids: Iterable[int]) -> EngineReport:
    """Where each of the replicas stands now."""
    ready, starting, failed = [], [], []
    replicas = Replica.objects.filter(pk__in=list(replica_ids)).select_related(
        "region__cloud").order_by("pk")
    for replica in replicas:
        name = f"{replica.public_id} ({replica.region.key})"
        if replica.state in SERVING_STATES:
            ready.append(name)
        elif replica.state in LAUNCHING_STATES:
            starting.append(name)
        else:
            failed.append(f"{name}: {replica.state}")
    return EngineReport(tuple(ready), tuple(starting), tuple(failed))


def wait_for_engines(replica_ids: Iterable[int], timeout_s: float, say: Callable[[str], None],
                     *, every_s: float = 0.5, give_up: Callable[[], bool] | None = None,
                     remind_s: float = REMIND_S) -> EngineReport:
    """Until none of the replicas is still launching, or `timeout_s` runs out, or `give_up`
    answers true (a process the lab needs died): returns where they stand then. Says which
    replicas it waits for whenever that changes, and every `remind_s` while it does not."""
    ids = list(replica_ids)
    shown: tuple[str, ...] = ()
    shown_at = 0.0

    def settled() -> EngineReport | None:
        nonlocal shown, shown_at
        report = engine_report(ids)
        if not report.starting or (give_up is not None and give_up()):
            return report
        now = time.monotonic()
        if report.starting != shown or now - shown_at >= remind_s:
            shown, shown_at = report.starting, now
            n = len(report.starting)
            say(f"  waiting for {n} engine{'s' if n != 1 else ''}: "
                + ", ".join(report.starting))
        return None

    if not ids:
        return EngineReport()
    try:
        return wait_until(settled, timeout_s, "the lab's engines to be ready", every_s)
    except WaitTimeout:
        return engine_report(ids)


def headline(report: EngineReport, waited_s: float) -> str:
    """"Meridian lab is up." when every engine is ready; otherwise what is not, by name."""
    if report.all_ready:
        return UP
    lines = [f"Meridian lab is running, but {len(report.ready)} of "
             f"{len(report.ready) + len(report.starting) + len(report.failed)} engines are ready."]
    if report.starting:
        lines.append(f"    Still starting after {waited_s:.0f} s: " + ", ".join(report.starting))
    if report.failed:
        lines.append("    Not starting: " + ", ".join(report.failed)
                     + " (its page and operation log say why)")
    return "\n".join(lines)

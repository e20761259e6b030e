"""An incident's timeline: its stages, what each one means, and why one is missing.

The same words are on the Failover page, in `failover_drill`'s output, in the API's
`stage_notes` and in docs/architecture.md, so an operator reads one definition everywhere.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone

from controlplane.failover.models import Incident

STAGES = ("detected_at", "tables_pushed_at", "replacement_ready_at", "traffic_back_at",
          "resolved_at")
# An incident closes this long after its replacements are ready when no traffic returns.
QUIET_RESOLVE = timedelta(seconds=60)

MEANINGS = {
    "detected": "the watch loop saw the first failure (a refused /health probe, or two "
                "timeouts in a row) and marked the replica failed",
    "tables_pushed": "every enabled edge acknowledged a routing table without the failed "
                     "replicas",
    "replacement_ready": "every replacement answers /health and lists the model (or none "
                         "was needed)",
    "traffic_back": "a replacement finished its first request (the engine's request counter, "
                    "sampled every 2 s)",
    "resolved": "tables are pushed and traffic is back; when no request reaches the "
                f"replacements, {QUIET_RESOLVE.total_seconds():.0f} s after they are ready "
                "(no traffic to wait for); when nothing needed replacing, "
                f"{QUIET_RESOLVE.total_seconds():.0f} s after detection",
}


def stage_name(stage: str) -> str:
    return stage.removesuffix("_at").replace("_", " ")


def timeline(incident: Incident) -> dict[str, float | None]:
    """Seconds from the start to each stage (None: not reached)."""
    out: dict[str, float | None] = {}
    for stage in STAGES:
        at = getattr(incident, stage)
        out[stage.removesuffix("_at") + "_s"] = (
            None if at is None else round((at - incident.started_at).total_seconds(), 3))
    return out


def missing(incident: Incident, now: datetime | None = None) -> dict[str, str]:
    """Why each stage not reached is missing, in words (never a bare null)."""
    now = now or timezone.now()
    why: dict[str, str] = {}
    closed = incident.resolved_at is not None
    if incident.detected_at is None:
        why["detected"] = ("no failure was seen" if closed
                           else "waiting for the watch loop's probes (every second)")
    if incident.tables_pushed_at is None:
        why["tables_pushed"] = ("an edge did not acknowledge a table" if closed
                                else "waiting for every enabled edge to acknowledge")
    if incident.replacement_ready_at is None:
        if not incident.replacements:
            why["replacement_ready"] = ("no replacement was needed" if closed
                                        else "no replacement placed yet (see the notes)")
        else:
            why["replacement_ready"] = (f"{', '.join(incident.replacements)} never became ready"
                                        if closed else
                                        f"starting: {', '.join(incident.replacements)}")
    if incident.traffic_back_at is None:
        if not incident.replacements:
            why["traffic_back"] = "nothing was replaced"
        elif closed:
            why["traffic_back"] = (f"no request reached the replacements within "
                                   f"{QUIET_RESOLVE.total_seconds():.0f} s of their being "
                                   "ready (the edges sent the model's traffic, if any, to "
                                   "other replicas)")
        elif incident.replacement_ready_at is not None:
            left = QUIET_RESOLVE - (now - incident.replacement_ready_at)
            why["traffic_back"] = (f"no request yet; resolves without one in "
                                   f"{max(left.total_seconds(), 0):.0f} s")
        else:
            why["traffic_back"] = "waiting for the replacements to be ready"
    if not closed:
        waiting = [stage_name(s) for s in STAGES[:-1] if getattr(incident, s) is None]
        why["resolved"] = "open: waiting for " + (", ".join(waiting) if waiting else "the next check")
    return why

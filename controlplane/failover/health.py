"""Health verdicts from probes and replica counts (DESIGN §6). Pure.

A replica whose /health probe is refused or reset has lost its process or its network:
one such probe fails it. A probe that times out may be a stall under load, so it takes
`TIMEOUTS_TO_FAIL` in a row. A region is down when at least `DOWN_AFTER_FAILURES` replicas
failed there recently and none serves (one lost replica is a replica's problem, not the
region's); degraded while a failure there is still being answered (its incident is open);
healthy again once it is resolved.
"""

from __future__ import annotations

from dataclasses import dataclass

TIMEOUTS_TO_FAIL = 2
DOWN_AFTER_FAILURES = 2


@dataclass(frozen=True)
class Probe:
    ok: bool
    timed_out: bool = False
    detail: str = ""


def replica_verdict(probe: Probe, timeouts_before: int) -> tuple[bool, int]:
    """(failed, consecutive timeouts to remember) after one probe."""
    if probe.ok:
        return False, 0
    if probe.timed_out:
        timeouts = timeouts_before + 1
        return timeouts >= TIMEOUTS_TO_FAIL, timeouts
    return True, 0


@dataclass(frozen=True)
class RegionCounts:
    serving: int  # ready or degraded
    starting: int  # pending, provisioning or starting
    failed_recently: int  # failed within the health window (terminated since or not)
    open_incident: bool = False  # a failure there is still being answered


def region_state(counts: RegionCounts) -> tuple[str, str]:
    """(healthy | degraded | down, reason)."""
    if counts.failed_recently >= DOWN_AFTER_FAILURES and not counts.serving:
        starting = f"; {counts.starting} starting" if counts.starting else ""
        return "down", f"{counts.failed_recently} replicas failed and none serves{starting}"
    if counts.failed_recently and counts.open_incident:
        failed, serving = counts.failed_recently, counts.serving
        return "degraded", (f"{failed} replica{'s' if failed != 1 else ''} failed recently; "
                            f"{serving} serve{'s' if serving == 1 else ''}")
    if not counts.serving:
        return "healthy", "no replicas"
    return "healthy", f"{counts.serving} replica{'s' if counts.serving != 1 else ''} serve" + (
        "s" if counts.serving == 1 else "")

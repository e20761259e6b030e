"""Health verdicts from probes and replica counts (DESIGN §6). Pure.

A replica whose /health probe is refused or reset has lost its process or its network:
one such probe fails it. A probe that times out may be a stall under load, so it takes
`TIMEOUTS_TO_FAIL` in a row; except when every replica of its region (at least
`CUT_OFF_MIN_REPLICAS`) timed out in the same pass while a replica elsewhere answered: engines
do not stall together, a region's network does (a partition drops packets and sends no
reset), so those timeouts fail at once (`cut_off_regions`).

A region is:

- down while a drill has killed it and nothing serves there again, or when at least
  `DOWN_AFTER_FAILURES` replicas failed there within `DOWN_HOLD_S` and none serves (one lost
  replica is a replica's problem, not the region's). Failures older than the region's newest
  live replica do not count: the region has been given a replica since (a restarted lab's
  leftovers, or a replacement placed there);
- degraded while a failure there is still being answered (its incident is open);
- idle when nothing serves there: no replicas, or only draining or starting ones, or a down
  region whose hold has passed ("recovered") and that holds nothing yet;
- healthy when replicas serve and none failed unanswered.

Every reason agrees with the failure count shown beside it (`failing`: failures within the
health window): a healthy or idle region that had failures says how many, answered.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TypeVar

TIMEOUTS_TO_FAIL = 2
CUT_OFF_MIN_REPLICAS = 2  # a region of one replica is judged as that one replica
DOWN_AFTER_FAILURES = 2
# How long a region that lost its replicas stays down without a new failure; after it, the
# region may take replacements again (the periodic replan moves displaced replicas back).
DOWN_HOLD_S = 60.0


@dataclass(frozen=True)
class Probe:
    ok: bool
    timed_out: bool = False
    detail: str = ""


def replica_verdict(probe: Probe, timeouts_before: int,
                    region_cut_off: bool = False) -> tuple[bool, int]:
    """(failed, consecutive timeouts to remember) after one probe; `region_cut_off`: its
    region is one of this pass's `cut_off_regions`."""
    if probe.ok:
        return False, 0
    if probe.timed_out:
        timeouts = timeouts_before + 1
        return region_cut_off or timeouts >= TIMEOUTS_TO_FAIL, timeouts
    return True, 0


Region = TypeVar("Region", bound=Hashable)


def cut_off_regions(probes: Iterable[tuple[Region, Probe]]) -> set[Region]:
    """Of one pass's (region, probe) pairs: the regions where every replica probed, at least
    CUT_OFF_MIN_REPLICAS, timed out while a replica in another region answered (so it is not
    the control plane's own network that failed)."""
    by_region: dict[Region, list[Probe]] = {}
    for region, probe in probes:
        by_region.setdefault(region, []).append(probe)
    answered = {region for region, found in by_region.items() if any(p.ok for p in found)}
    return {region for region, found in by_region.items()
            if len(found) >= CUT_OFF_MIN_REPLICAS and all(p.timed_out for p in found)
            and answered - {region}}


@dataclass(frozen=True)
class RegionCounts:
    serving: int  # ready or degraded
    starting: int  # pending, provisioning or starting
    failed_recently: int  # failed within the health window (terminated since or not)
    open_incident: bool = False  # a failure there is still being answered
    draining: int = 0
    # Failures within DOWN_HOLD_S and after the region's newest live replica was created;
    # None: the same as failed_recently.
    failed_lately: int | None = None
    drill: bool = False  # an open drill killed this region


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def region_state(counts: RegionCounts) -> tuple[str, str]:
    """(healthy | degraded | down | idle, reason)."""
    lately = counts.failed_recently if counts.failed_lately is None else counts.failed_lately
    starting = f"; {counts.starting} starting" if counts.starting else ""
    if not counts.serving and counts.drill and counts.failed_recently:
        return "down", f"drill: {_plural(counts.failed_recently, 'replica')} killed and none serves{starting}"
    if lately >= DOWN_AFTER_FAILURES and not counts.serving:
        return "down", f"{lately} replicas failed and none serves{starting}"
    if counts.failed_recently and counts.open_incident:
        failed, serving = counts.failed_recently, counts.serving
        return "degraded", (f"{_plural(failed, 'replica')} failed recently; "
                            f"{serving} serve{'s' if serving == 1 else ''}")
    if not counts.serving:
        waiting = [_plural(n, "replica") + " " + what for n, what in
                   ((counts.draining, "draining"), (counts.starting, "starting")) if n]
        if counts.failed_recently >= DOWN_AFTER_FAILURES:
            return "idle", (f"recovered from {counts.failed_recently} failures; nothing serves "
                            "here yet" + (f" ({', '.join(waiting)})" if waiting else ""))
        if waiting:
            return "idle", "nothing serves: " + ", ".join(waiting) + _answered(counts)
        return "idle", "no replicas" + _answered(counts)
    return "healthy", f"{counts.serving} replica{'s' if counts.serving != 1 else ''} serve" + (
        "s" if counts.serving == 1 else "") + _answered(counts)


def _answered(counts: RegionCounts) -> str:
    """What a region's state leaves out of its failure count: failures already answered
    (their incident closed), so that a reason never contradicts the `failing` beside it."""
    if not counts.failed_recently:
        return ""
    failed = counts.failed_recently
    return f"; {_plural(failed, 'replica')} failed recently (answered)"

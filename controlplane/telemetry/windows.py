"""Counters over a window of scrapes: how much they grew, the scrapes at the window's ends,
and rates.

Engines and edges export cumulative counters that start again from zero when the process
restarts. A reading lower than the one before it therefore means a restart: what the
counter grew by since is the new reading itself, and counting goes on from there. Growth
over a window sums the growth between each pair of consecutive readings, so a restart in
the middle of the window loses only what was counted between the last scrape before it and
the restart.

The growth and rate functions are pure. `newest`, `oldest` and `ends` build querysets over
samples (rows with an `at` time, one source per `by` field such as "replica_id" or
"edge_id"); they run nothing until the caller reads the rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import TypeVar

from django.db.models import Model, QuerySet

Counters = Mapping[str, float]
Reading = tuple[datetime, Counters]  # a scrape's time and its counters
M = TypeVar("M", bound=Model)


def grown(newer: float, older: float) -> float:
    """What one counter grew by between two readings; lower than before: the engine
    restarted and the newer reading counts whole."""
    return newer - older if newer >= older else newer


def growth(readings: Sequence[Counters], keys: Iterable[str] | None = None,
           from_zero: bool = False) -> dict[str, float]:
    """Per key, how much counters grew over readings in time order, each restart counted
    from its new start; keys that did not grow are left out. `keys`: only these (default:
    every key of every reading after the first). `from_zero`: the source began inside the
    window, so the first reading's counts all fall in it."""
    if not readings:
        return {}
    steps = list(readings) if not from_zero else [{}, *readings]
    wanted = (list(keys) if keys is not None
              else list(dict.fromkeys(k for reading in steps[1:] for k in reading)))
    out: dict[str, float] = {}
    for key in wanted:
        total = sum(grown(float(newer.get(key, 0.0)), float(older.get(key, 0.0)))
                    for older, newer in zip(steps, steps[1:], strict=False))
        if total > 0:
            out[key] = total
    return out


def histogram_growth(readings: Sequence[Counters]) -> dict[str, float]:
    """Observations per bucket over cumulative histogram readings in time order. A reading
    with any bucket lower than before follows a restart: its buckets count whole. Every
    bucket of the later readings is kept, empty ones too (they bound the quantiles)."""
    out: dict[str, float] = {}
    for older, newer in zip(readings, readings[1:], strict=False):
        restarted = any(newer.get(le, 0.0) < count for le, count in older.items())
        for le, count in newer.items():
            step = count if restarted else count - older.get(le, 0.0)
            out[le] = out.get(le, 0.0) + step
    return out


def per_second(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def rate(readings: Sequence[Reading], key: str) -> float:
    """How fast one counter grew per second from the first reading to the last (restarts
    counted from their new start); 0 with fewer than two readings or no time between."""
    if len(readings) < 2:
        return 0.0
    seconds = (readings[-1][0] - readings[0][0]).total_seconds()
    return per_second(growth([c for _, c in readings], (key,)).get(key, 0.0), seconds)


def from_start(readings: Iterable[Reading], start: datetime) -> list[Reading]:
    """Readings in time order from the newest at or before `start` (the window's first
    end) on; the older ones before it are dropped."""
    out: list[Reading] = []
    for at, counters in readings:
        if at <= start and out:
            out[0] = (at, counters)
        else:
            out.append((at, counters))
    return out


def newest(rows: QuerySet[M], by: str) -> QuerySet[M]:
    """Each source's newest row among `rows` (one query, DISTINCT ON `by`)."""
    return rows.order_by(by, "-at").distinct(by)


def oldest(rows: QuerySet[M], by: str) -> QuerySet[M]:
    """Each source's oldest row among `rows`."""
    return rows.order_by(by, "at").distinct(by)


def ends(rows: QuerySet[M], by: str, start: datetime,
         end: datetime | None = None) -> tuple[QuerySet[M], QuerySet[M]]:
    """Each source's rows at the window's two ends: its newest at or before `start`, and its
    newest at or before `end` (None: its newest of all)."""
    if end is not None:
        rows = rows.filter(at__lte=end)
    return newest(rows.filter(at__lte=start), by), newest(rows, by)

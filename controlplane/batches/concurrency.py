"""How many of a batch's lines a worker sends at once: additive increase, multiplicative
decrease (AIMD), as TCP does. Pure: the caller gathers the signals and keeps the number.

The number is halved when the last round met pressure — answers that say the capacity is
taken (429, 503), the target replicas' queues or KV cache filling up, or the replicas' TTFT
rising over what it was before the batch began (interactive requests wait behind the
batch's prefills) — and grows by one otherwise, so a batch takes spare capacity slowly and
gives it back at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    floor: int = 1
    ceiling: int = 64
    waiting_high: float = 4.0  # requests waiting on one target replica
    kv_high: float = 0.9  # a target replica's KV cache usage
    ttft_rise: float = 1.2  # TTFT p95 over its baseline by this factor…
    ttft_floor_s: float = 0.2  # …and over this (a few ms more on a fast answer hurt no one)


@dataclass(frozen=True)
class Pressure:
    """What the last round of sends met."""

    sent: int
    refused: int = 0  # answers 429 or 503: at capacity
    waiting: float = 0.0  # the most requests waiting on any target replica
    kv_usage: float = 0.0  # the highest KV cache usage of any target replica
    ttft_p95_s: float | None = None  # the target replicas' TTFT p95 now
    ttft_baseline_s: float | None = None  # before the batch's first send, or lower since


def pressure_reason(pressure: Pressure, limits: Limits) -> str:
    """Why to back off, or "" when nothing says so."""
    if pressure.refused:
        return f"{pressure.refused} of {pressure.sent} sends refused (at capacity)"
    if pressure.waiting >= limits.waiting_high:
        return f"{pressure.waiting:g} requests waiting on a target replica"
    if pressure.kv_usage >= limits.kv_high:
        return f"KV cache {pressure.kv_usage:.0%} full on a target replica"
    now, base = pressure.ttft_p95_s, pressure.ttft_baseline_s
    if now is not None and base is not None and base > 0 and now > base * limits.ttft_rise \
            and now > limits.ttft_floor_s:
        return f"TTFT p95 {now * 1000:.0f} ms, over {limits.ttft_rise:g}x its {base * 1000:.0f} ms"
    return ""


def next_concurrency(current: int, pressure: Pressure, limits: Limits = Limits()
                     ) -> tuple[int, str]:
    """The next round's concurrency and why it changed ("" when it grew)."""
    reason = pressure_reason(pressure, limits)
    if reason:
        return max(limits.floor, current // 2), reason
    if pressure.sent < current:
        # Fewer lines were due than allowed: nothing was learnt about more.
        return max(limits.floor, min(limits.ceiling, current)), ""
    return max(limits.floor, min(limits.ceiling, current + 1)), ""


def lower_baseline(baseline_s: float | None, ttft_p95_s: float | None) -> float | None:
    """The TTFT low-water mark after a new reading: the lowest seen."""
    if ttft_p95_s is None or ttft_p95_s <= 0:
        return baseline_s
    return ttft_p95_s if baseline_s is None else min(baseline_s, ttft_p95_s)

"""Autoscaling decisions: how many replicas a deployment should run, and why. Pure.

The input is a deployment's settings, its replica count (serving plus starting), the rounds
of engine samples the telemetry loop stored for its serving replicas (one round per scrape,
every 2 s), when it last scaled, and the requests edges could not route to it. The output is
the count wanted, with a reason naming the signals and the values that drove it.

Rules:
- Demand: ceil(in-flight ÷ target_inflight_per_replica) replicas, plus the warm pool for the
  interactive tier (idle replicas kept ready for bursts).
- Breaches: requests waiting per replica, KV cache usage and the deployment's TTFT p95 over
  its SLO each ask for more replicas once they have held for `up_window_s` without a break.
- A breach is counted against the replicas serving; replicas still starting are capacity on
  its way, so one breach does not scale up twice while they start.
- Scale-down only when in-flight stayed below `down_utilisation` of what one replica fewer
  (beyond the warm pool) could hold, with no breach, for `down_window_s`, past
  scale_down_cooldown_s, and by at most half the replicas at a time.
- The batch tier with min_replicas 0 scales to zero after the same idle window, and back to
  one as soon as an edge receives a request for it; the interactive tier keeps at least one.
- Always within [min_replicas, max_replicas]; a count outside the bounds is corrected at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

UP = "up"
DOWN = "down"

# A signal must hold this long (three 2 s scrapes) before it scales up: with a 2 s scrape and
# a 2 s decision loop a breach becomes a decision within 10 s of its start.
UP_WINDOW_S = 4.0
DOWN_WINDOW_S = 60.0
KV_HIGH = 0.9  # KV cache usage (fraction) that counts as a breach
KV_TARGET = 0.75  # a KV breach asks for enough replicas to bring usage back to this
QUEUE_HIGH = 1.0  # requests waiting per serving replica that count as a breach
DOWN_UTILISATION = 0.6  # scale down below this share of what one replica fewer holds
STALE_AFTER_S = 10.0  # samples older than this are not acted on
# Scrapes are not exactly 2 s apart (beat and the scrape itself jitter): a run of scrapes
# counts as lasting a window when it falls short of it by no more than this.
JITTER_S = 0.5
MAX_DOWN_FRACTION = 0.5  # remove at most half the replicas in one decision


@dataclass(frozen=True)
class Settings:
    """A deployment's autoscaling settings, with the loop's thresholds."""

    tier: str = "interactive"
    min_replicas: int = 1
    max_replicas: int = 4
    target_inflight_per_replica: int = 24
    warm_pool: int = 0
    slo_ttft_p95_ms: float = 1000.0
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 300.0
    up_window_s: float = UP_WINDOW_S
    down_window_s: float = DOWN_WINDOW_S
    kv_high: float = KV_HIGH
    kv_target: float = KV_TARGET
    queue_high: float = QUEUE_HIGH
    down_utilisation: float = DOWN_UTILISATION
    stale_after_s: float = STALE_AFTER_S
    jitter_s: float = JITTER_S

    @classmethod
    def of(cls, deployment: Any, **thresholds: Any) -> Settings:
        return cls(
            tier=deployment.tier, min_replicas=deployment.min_replicas,
            max_replicas=deployment.max_replicas,
            target_inflight_per_replica=max(int(deployment.target_inflight_per_replica), 1),
            warm_pool=deployment.warm_pool, slo_ttft_p95_ms=float(deployment.slo_ttft_p95_ms),
            scale_up_cooldown_s=float(deployment.scale_up_cooldown_s),
            scale_down_cooldown_s=float(deployment.scale_down_cooldown_s), **thresholds,
        )

    @property
    def interactive(self) -> bool:
        return self.tier != "batch"

    @property
    def warm(self) -> int:
        """Idle replicas kept beyond demand: the interactive tier's warm pool."""
        return self.warm_pool if self.interactive else 0

    @property
    def floor(self) -> int:
        """The fewest replicas: min_replicas; the interactive tier never goes to zero."""
        return max(self.min_replicas, 1 if self.interactive else 0)


@dataclass(frozen=True)
class Round:
    """One scrape of a deployment's serving replicas, summed (times in epoch seconds)."""

    at: float
    replicas: int  # replicas that answered this scrape
    running: float = 0.0
    waiting: float = 0.0
    kv_mean: float = 0.0
    kv_max: float = 0.0
    ttft_p95_s: float | None = None  # over every request since the previous scrape
    ttft_count: float = 0.0  # first tokens observed since the previous scrape

    @property
    def inflight(self) -> float:
        return self.running + self.waiting

    @property
    def queue_per_replica(self) -> float:
        return self.waiting / self.replicas if self.replicas else 0.0


@dataclass(frozen=True)
class Fleet:
    """The deployment's replicas that count: serving, and on their way (pending → starting)."""

    serving: int
    starting: int = 0
    failed_unreplaced: int = 0  # failed replicas reconcile will replace; not ours to replace

    @property
    def count(self) -> int:
        return self.serving + self.starting


@dataclass(frozen=True)
class History:
    last_up_at: float | None = None
    last_down_at: float | None = None

    @property
    def last_at(self) -> float | None:
        times = [t for t in (self.last_up_at, self.last_down_at) if t is not None]
        return max(times) if times else None


@dataclass(frozen=True)
class Decision:
    direction: str | None  # up | down | None (hold)
    before: int
    after: int
    reason: str
    signals: dict[str, Any] = field(default_factory=dict)

    @property
    def acts(self) -> bool:
        return self.direction is not None and self.after != self.before


# -- sustained signals --------------------------------------------------------------------------

Verdict = Callable[[Round], "bool | None"]  # None: this round cannot tell (no data)


def sustained_since(rounds: Sequence[Round], verdict: Verdict) -> float | None:
    """When the unbroken run of rounds that satisfy `verdict`, ending at the newest round that
    can tell, began; None when that newest round does not satisfy it. Rounds that cannot tell
    neither start nor break a run."""
    since = None
    for r in reversed(rounds):
        held = verdict(r)
        if held is None:
            continue
        if not held:
            break
        since = r.at
    return since


def _held_for(rounds: Sequence[Round], verdict: Verdict) -> float:
    since = sustained_since(rounds, verdict)
    return 0.0 if since is None else rounds[-1].at - since


def demand_replicas(inflight: float, s: Settings) -> int:
    """Replicas that hold `inflight` requests at the target, plus the warm pool."""
    return math.ceil(max(inflight, 0.0) / s.target_inflight_per_replica - 1e-9) + s.warm


def _ttft_over(r: Round, s: Settings) -> bool | None:
    if r.ttft_p95_s is None or r.ttft_count <= 0:
        return None
    return r.ttft_p95_s * 1000.0 > s.slo_ttft_p95_ms


# -- the decision -------------------------------------------------------------------------------

def decide(s: Settings, fleet: Fleet, rounds: Sequence[Round], history: History, now: float,
           unserved_requests: float = 0.0) -> Decision:
    """The replica count `s` wants now, and why. `rounds` are oldest first."""
    n = fleet.count
    rounds = sorted(rounds, key=lambda r: r.at)
    fresh = bool(rounds) and now - rounds[-1].at <= s.stale_after_s
    latest = rounds[-1] if fresh else None
    signals = _signals(s, fleet, latest, unserved_requests)

    def hold(reason: str) -> Decision:
        return Decision(None, n, n, reason, signals)

    # Bounds first: a count outside [floor, max] is corrected at once, without cooldowns.
    if n > s.max_replicas:
        return Decision(DOWN, n, s.max_replicas,
                        f"{n} replicas exceed max_replicas {s.max_replicas}", signals)
    if n < s.floor and fleet.failed_unreplaced == 0:
        return Decision(UP, n, s.floor, f"{n} replicas are below the minimum {s.floor}"
                        + ("" if s.min_replicas >= s.floor else " (interactive tier keeps one)"),
                        signals)
    # Scale from zero: no replica serves, so the only demand signal is the edges'.
    if n == 0:
        if unserved_requests > 0:
            after = min(max(s.floor, 1), s.max_replicas)
            return Decision(UP, 0, after, f"{unserved_requests:g} request(s) reached the edges "
                            "with no replica serving: scale from zero", signals)
        return hold("scaled to zero; no requests at the edges")
    if latest is None:
        return hold("no fresh samples from serving replicas")

    up = _wanted_up(s, fleet, rounds, latest, signals)
    if up is not None:
        after, reasons = up
        after = min(after, s.max_replicas)
        if after > n:
            waited = None if history.last_up_at is None else now - history.last_up_at
            if waited is not None and waited < s.scale_up_cooldown_s:
                return hold(f"scale-up cooldown: {waited:.0f} s of {s.scale_up_cooldown_s:g} s "
                            f"since the last ({'; '.join(reasons)})")
            return Decision(UP, n, after, "; ".join(reasons), signals)
        if n >= s.max_replicas:
            return hold(f"at max_replicas {s.max_replicas} ({'; '.join(reasons)})")
        return hold(f"capacity on its way covers it ({'; '.join(reasons)})")

    down = _wanted_down(s, fleet, rounds, latest, signals)
    if down is None:
        return hold("within target")
    after, reason = down
    last = history.last_at
    if last is not None and now - last < s.scale_down_cooldown_s:
        return hold(f"scale-down cooldown: {now - last:.0f} s of {s.scale_down_cooldown_s:g} s "
                    f"since the last decision ({reason})")
    return Decision(DOWN, n, after, reason, signals)


def _wanted_up(s: Settings, fleet: Fleet, rounds: Sequence[Round], latest: Round,
               signals: dict[str, Any]) -> tuple[int, list[str]] | None:
    """The most replicas any sustained signal asks for, with the reasons; None if none does."""
    n, serving = fleet.count, fleet.serving
    window = s.up_window_s - s.jitter_s
    wants: list[tuple[int, str]] = []
    held = signals["sustained_s"]

    demand = demand_replicas(latest.inflight, s)
    t = _held_for(rounds, lambda r: demand_replicas(r.inflight, s) > n)
    held["inflight"] = round(t, 2)
    if t >= window:
        warm = f" + warm pool {s.warm}" if s.warm else ""
        wants.append((demand, f"in-flight {latest.inflight:g} needs {demand - s.warm} replicas "
                      f"at {s.target_inflight_per_replica}/replica{warm} for {t:.0f} s"))

    t = _held_for(rounds, lambda r: r.queue_per_replica >= s.queue_high)
    held["queue"] = round(t, 2)
    if t >= window:
        extra = max(1, math.ceil(latest.waiting / s.target_inflight_per_replica))
        wants.append((serving + extra, f"queue {latest.queue_per_replica:.1f} waiting/replica "
                      f"≥ {s.queue_high:g} for {t:.0f} s"))

    t = _held_for(rounds, lambda r: r.kv_mean >= s.kv_high)
    held["kv"] = round(t, 2)
    if t >= window:
        wanted = max(serving + 1, math.ceil(serving * latest.kv_mean / s.kv_target))
        wants.append((wanted, f"KV cache {latest.kv_mean:.0%} ≥ {s.kv_high:.0%} for {t:.0f} s"))

    since = sustained_since(rounds, lambda r: _ttft_over(r, s))
    t = 0.0 if since is None else latest.at - since
    held["ttft"] = round(t, 2)
    if t >= window:
        p95 = max((r.ttft_p95_s or 0.0) for r in rounds if r.at >= (since or 0.0))
        wants.append((serving + 1, f"TTFT p95 {p95 * 1000:.0f} ms > SLO "
                      f"{s.slo_ttft_p95_ms:g} ms for {t:.0f} s"))
    if not wants:
        return None
    return max(w for w, _ in wants), [why for _, why in wants]


def _breached(r: Round, s: Settings) -> bool:
    return (r.queue_per_replica >= s.queue_high or r.kv_mean >= s.kv_high
            or bool(_ttft_over(r, s)))


def _wanted_down(s: Settings, fleet: Fleet, rounds: Sequence[Round], latest: Round,
                 signals: dict[str, Any]) -> tuple[int, str] | None:
    n = fleet.count
    if n <= s.floor or fleet.starting:
        return None
    target = s.target_inflight_per_replica

    def low(r: Round) -> bool:
        if _breached(r, s):
            return False
        if r.inflight <= 0:
            return True  # idle: what lets the batch tier reach zero
        return r.inflight < s.down_utilisation * (n - 1 - s.warm) * target

    since = sustained_since(rounds, low)
    t = 0.0 if since is None else latest.at - since
    signals["sustained_s"]["low"] = round(t, 2)
    if t < s.down_window_s - s.jitter_s:
        return None
    peak = max(r.inflight for r in rounds if r.at >= (since or 0.0))
    keep = math.ceil(peak / (s.down_utilisation * target) - 1e-9) + s.warm if peak > 0 else s.warm
    after = max(s.floor, keep, n - max(1, int(n * MAX_DOWN_FRACTION)))
    if after >= n:
        return None
    if after == 0:
        return 0, f"idle for {t:.0f} s: batch tier scales to zero"
    hold_note = f" + warm pool {s.warm}" if s.warm else ""
    return after, (f"in-flight peak {peak:g} below {s.down_utilisation:.0%} of what "
                   f"{n - 1 - s.warm} replica(s){hold_note} hold at {target}/replica "
                   f"for {t:.0f} s")


def _signals(s: Settings, fleet: Fleet, latest: Round | None, unserved: float) -> dict[str, Any]:
    """The values a decision is recorded with."""
    out: dict[str, Any] = {
        "serving": fleet.serving, "starting": fleet.starting,
        "target_inflight_per_replica": s.target_inflight_per_replica,
        "warm_pool": s.warm, "slo_ttft_p95_ms": s.slo_ttft_p95_ms,
        "min_replicas": s.min_replicas, "max_replicas": s.max_replicas, "tier": s.tier,
        "sustained_s": {},
    }
    if unserved:
        out["unserved_requests"] = unserved
    if latest is not None:
        out.update(
            sampled_at=latest.at, replicas_sampled=latest.replicas,
            inflight=latest.inflight, running=latest.running, waiting=latest.waiting,
            queue_per_replica=round(latest.queue_per_replica, 3),
            kv_mean=round(latest.kv_mean, 4), kv_max=round(latest.kv_max, 4),
            ttft_p95_ms=None if latest.ttft_p95_s is None else round(latest.ttft_p95_s * 1000, 1),
        )
    return out


# -- during a rollout (the deployment split between its stable and canary revisions) -------

def split_scale_up(add: int, canary_weight: float) -> tuple[int, int]:
    """(stable, canary): how many of `add` new replicas run each revision while a rollout
    is in progress, in proportion to the canary's share (%) of the traffic; the rounding
    goes to the stable revision, so one replica added at 50% is a stable one."""
    share = min(max(canary_weight, 0.0), 100.0)
    canary = math.floor(add * share / 100.0 + 1e-9)
    return add - canary, canary


def canary_share(canary_weight: float, region_weights: Mapping[str, float]) -> float:
    """The canary's share of the deployment's traffic: its weight, or, for a rollout in
    waves (weights by edge region), the mean over the regions it has reached."""
    if region_weights:
        return sum(region_weights.values()) / len(region_weights)
    return canary_weight


RevisionKey = TypeVar("RevisionKey", bound=Hashable)


def keeps_each_revision(revision: RevisionKey, serving: bool,
                        serving_left: Mapping[RevisionKey, int]) -> bool:
    """Whether a replica of `revision` may go during a rollout: not the last serving one of
    its revision (the canary would lose its only replica, or the stable its last)."""
    return not serving or serving_left.get(revision, 0) > 1

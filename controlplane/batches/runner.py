"""The batch runner: the worker loop that claims a batch's due lines, sends them
(`transport`), stores each result once, adapts how many go at once, and ends the batch
(`results.finalize`) when no line is left.

`process()` claims a chunk of lines with `FOR UPDATE SKIP LOCKED` (so several workers
share one batch without sending a line twice). How many lines go at once adapts
(`concurrency`: halved when sends are refused for capacity or the target replicas' queues,
KV cache or TTFT say so, one more otherwise), and what was learnt is shared between the
batch's runners (`concurrency_cache`). Each line's result is stored exactly once with a
conditional UPDATE keyed on (batch, custom_id): a line whose result is stored is never
claimed again. 429, 5xx, timeouts and refused connections are retried with exponential
backoff and jitter up to `BATCH_MAX_ATTEMPTS`; other answers are final.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import transaction
from django.db.models import F, Min, Q
from django.utils import timezone

from controlplane.batches.concurrency import Limits, Pressure, lower_baseline, next_concurrency
from controlplane.batches.concurrency_cache import Learnt, load_concurrency, save_concurrency
from controlplane.batches.config import number
from controlplane.batches.lease import abandoned, held, lease
from controlplane.batches.models import FINISHED, Batch, BatchLine, BatchStatus, LineState
from controlplane.batches.results import finalize
from controlplane.batches.transport import (
    EDGE_RECHECK_S,
    NO_REPLICA_CODE,
    EdgeRoute,
    Outcome,
    edge_route,
    edge_unready,
    eligible_replicas,
    has_batch_pool,
    targets,
)
from controlplane.deployments.models import Replica
from controlplane.telemetry.services import metrics_source

log = logging.getLogger(__name__)


def wake_recheck_s() -> float:
    """How soon a line the edge answered "no replica" is sent again: while a batch pool
    wakes, one send this often keeps the edges counting the demand that wakes it."""
    return number("BATCH_WAKE_RECHECK_S", 2.0)


def _wait_cap() -> float:
    """The longest a runner waits between runs of a batch: the backoff cap."""
    return number("BATCH_BACKOFF_MAX_S", 60.0)


def backoff_s(attempt: int, retry_after_s: float | None = None) -> float:
    """Exponential with jitter: half the step fixed, half random; never below Retry-After."""
    base = number("BATCH_BACKOFF_BASE_S", 1.0)
    step = min(_wait_cap(), base * 2 ** max(0, attempt - 1))
    delay = step / 2 + random.uniform(0, step / 2)
    return max(delay, retry_after_s or 0.0)


# -- lines ------------------------------------------------------------------------------------


def claim(batch: Batch, worker: str, size: int) -> list[BatchLine]:
    """Up to `size` lines due now (queued, or held past the lease by a worker that died),
    locked with SKIP LOCKED so concurrent workers take different lines."""
    now = timezone.now()
    due = Q(state=LineState.QUEUED) & (Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now))
    with transaction.atomic():
        ids = list(BatchLine.objects.select_for_update(skip_locked=True)
                   .filter(batch=batch).filter(due | abandoned(now))
                   .order_by("line_number").values_list("pk", flat=True)[:size])
        BatchLine.objects.filter(pk__in=ids).update(
            state=LineState.RUNNING, claimed_at=now, worker=worker, attempts=F("attempts") + 1)
    return list(BatchLine.objects.filter(pk__in=ids).order_by("line_number"))


def record(line: BatchLine, worker: str, outcome: Outcome) -> bool:
    """Store a line's outcome once. Success or a final failure is written by an UPDATE that
    only matches while the line has no stored result and this worker still holds it; a
    retryable failure puts it back in the queue with a backoff, unless its attempts are
    spent. True when this call wrote.

    A worker whose lease ran out may find its lines claimed again by another: it stores
    nothing for them, the other worker's send does. Storing it anyway would race that
    claim, and the other worker would send a line whose result was already stored."""
    now = timezone.now()
    max_attempts = int(number("BATCH_MAX_ATTEMPTS", 5))
    unfinished = BatchLine.objects.filter(batch_id=line.batch_id, custom_id=line.custom_id,
                                          finished_at__isnull=True, state=LineState.RUNNING,
                                          worker=worker)
    if outcome.status is not None and 200 <= outcome.status < 300:
        return unfinished.update(state=LineState.DONE, response_status=outcome.status,
                                 request_id=outcome.request_id, result=outcome.body,
                                 error=None, finished_at=now) == 1
    if outcome.no_replica:
        # The model's replicas are waking (scaled to zero, starting): not an attempt. The
        # line goes back unclaimed for a while; the batch's window still bounds the wait.
        return unfinished.update(
            state=LineState.QUEUED, worker="", attempts=F("attempts") - 1,
            next_attempt_at=now + timedelta(seconds=wake_recheck_s()),
            response_status=outcome.status,
            error={"code": NO_REPLICA_CODE,
                   "message": "no replica of the model was serving; sent again once one "
                              "is (not counted as an attempt)"}) == 1
    if outcome.retryable and line.attempts < max_attempts:
        return unfinished.update(
            state=LineState.QUEUED, worker="",
            next_attempt_at=now + timedelta(seconds=backoff_s(line.attempts,
                                                               outcome.retry_after_s)),
            response_status=outcome.status, error=_error_of(outcome, line.attempts)) == 1
    return unfinished.update(state=LineState.FAILED, response_status=outcome.status,
                             request_id=outcome.request_id, result=outcome.body,
                             error=_error_of(outcome, line.attempts), finished_at=now) == 1


def _error_of(outcome: Outcome, attempts: int) -> dict[str, str]:
    if outcome.status is None:
        return {"code": "request_failed",
                "message": f"{outcome.error or 'no answer'} (after {attempts} attempts)"}
    message = ""
    if isinstance(outcome.body, dict):
        inner = outcome.body.get("error")
        message = inner.get("message", "") if isinstance(inner, dict) else str(inner or "")
    return {"code": f"http_{outcome.status}",
            "message": f"{message or 'the engine answered ' + str(outcome.status)} "
                       f"(after {attempts} attempts)"}


def stalled_batches() -> list[str]:
    """Unfinished batches no worker has run for `BATCH_STALL_S` (300 s, more than a
    request's timeout plus a task's budget plus the longest wait between runs, the backoff
    cap): their task message was lost (a countdown held by a worker that was killed), so
    the sweep queues them again."""
    cutoff = timezone.now() - timedelta(seconds=number("BATCH_STALL_S", 300))
    rows = (Batch.objects.exclude(status__in=FINISHED).filter(created_at__lt=cutoff)
            .filter(Q(last_run_at__isnull=True) | Q(last_run_at__lt=cutoff)))
    return list(rows.order_by("created_at").values_list("pk", flat=True))


# -- concurrency ------------------------------------------------------------------------------


def concurrency_limits() -> Limits:
    return Limits(floor=1, ceiling=int(number("BATCH_MAX_CONCURRENCY", 64)))


def replica_pressure(replicas: list[Replica], sent: int, refused: int,
                     baseline_s: float | None) -> Pressure:
    """A round's answers and the target replicas' latest load, as AIMD reads them."""
    stats = metrics_source().replica_stats({str(r.pk): r.url for r in replicas},
                                           window_s=int(number("BATCH_PRESSURE_WINDOW_S", 15)))
    live = [s for s in stats.values() if s.up]
    ttfts = [s.ttft_p95_s for s in live if s.ttft_p95_s is not None]
    return Pressure(sent=sent, refused=refused,
                    waiting=max((s.waiting for s in live), default=0.0),
                    kv_usage=max((s.kv_usage for s in live), default=0.0),
                    ttft_p95_s=max(ttfts) if ttfts else None, ttft_baseline_s=baseline_s)


def _adapt(state: Learnt, pressure: Pressure, limits: Limits, batch_id: str) -> None:
    state["n"], why = next_concurrency(state["n"], pressure, limits)
    if why:
        log.info("batch %s: concurrency %d (%s)", batch_id, state["n"], why)
    state["ttft_baseline_s"] = lower_baseline(state["ttft_baseline_s"], pressure.ttft_p95_s)


# -- the loop ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stop:
    """The end of a run: None, the batch is finished; a number, seconds until it is due."""

    wait: float | None


@dataclass
class Run:
    """One call of `process`: the batch, where its lines go, and what the run learns."""

    batch: Batch
    worker: str
    route: EdgeRoute | None
    pooled: bool
    state: Learnt | None
    timeout_s: float = field(default_factory=lambda: number("BATCH_REQUEST_TIMEOUT_S", 120.0))
    limits: Limits = field(default_factory=concurrency_limits)
    route_checked: bool = False
    # The replicas' load is read every few seconds (telemetry is sampled no faster); each
    # round's answers count every round.
    pressure_every_s: float = field(
        default_factory=lambda: number("BATCH_PRESSURE_EVERY_S", 5.0))
    pressure_at: float = field(default_factory=time.monotonic)


def process(batch_id: str, worker: str, budget_s: float = 30.0) -> float | None:
    """Run a batch's due lines for about `budget_s`. None: the batch is finished (or was);
    a number: seconds until a line is next due, for the caller to come back then."""
    batch = Batch.objects.select_related("tenant").get(pk=batch_id)
    if batch.status in FINISHED:
        return None
    Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
        status=BatchStatus.IN_PROGRESS, in_progress_at=timezone.now())
    Batch.objects.filter(pk=batch.pk).update(last_run_at=timezone.now())
    # What the batch's runners learnt so far, or BATCH_CHUNK to begin with.
    state = load_concurrency(batch.pk)
    run = Run(batch, worker, edge_route(batch), has_batch_pool(batch), state)
    started = timezone.now()
    while True:
        stop = _round(run)
        if stop is not None:
            return stop.wait
        if (timezone.now() - started).total_seconds() >= budget_s:
            return 0.0


def _round(run: Run) -> Stop | None:
    """Claim, send and record one chunk of lines; a Stop ends the run."""
    stop = _batch_stops(run.batch)
    if stop is not None:
        return stop
    replicas = eligible_replicas(run.batch, run.pooled)
    # A batch pool with no replica (scaled to zero) is woken by the edge: it counts the
    # requests it could not route, and the autoscaler brings the pool up on them. So one
    # line at a time is sent, and its "no replica" answer is not an attempt.
    waking = not replicas and run.pooled and run.route is not None
    if not replicas and not waking:
        # Nothing to send to (a region down, replicas still starting): no line is claimed
        # and no attempt spent; the batch waits, until its window ends.
        return Stop(None if _idle(run.batch) is None else _wait_cap())
    stop = _edge_stops(run)
    if stop is not None:
        return stop
    state = _learnt(run, replicas)
    lines = claim(run.batch, run.worker, 1 if waking else state["n"])
    if not lines:
        return Stop(_idle(run.batch))
    outcomes = _send(run, lines, replicas)
    if waking and all(o.no_replica for o in outcomes):
        return Stop(wake_recheck_s())  # still waking: come back, holding the rest unclaimed
    _learn(run, state, replicas, len(lines), outcomes)
    return None


def _batch_stops(batch: Batch) -> Stop | None:
    """A Stop when the batch is cancelled, finished or past its window."""
    batch.refresh_from_db(fields=["status"])
    if batch.status == BatchStatus.CANCELLING:
        if batch.lines.filter(held(timezone.now())).exists():
            return Stop(_wait_cap())
        finalize(batch.pk, BatchStatus.CANCELLED)
        return Stop(None)
    if batch.status in FINISHED:
        return Stop(None)
    if timezone.now() >= batch.expires_at:
        finalize(batch.pk, BatchStatus.EXPIRED)
        return Stop(None)
    return None


def _edge_stops(run: Run) -> Stop | None:
    """A Stop while the edge cannot take lines: none is claimed and no attempt spent, so an
    edge restarting does not use up the lines' attempts. Checked once, and again after a
    send got no answer."""
    if run.route is None or run.route_checked:
        return None
    why = edge_unready(run.route)
    if why:
        log.info("batch %s waits: %s", run.batch.pk, why)
        return Stop(min(_wait_cap(), EDGE_RECHECK_S))
    run.route_checked = True
    return None


def _learnt(run: Run, replicas: list[Replica]) -> Learnt:
    """What the runners learnt; before the batch's first send, BATCH_CHUNK lines at once and
    the replicas' TTFT without the batch as the baseline a rise is measured against."""
    if run.state is None:
        baseline = replica_pressure(replicas, 0, 0, None).ttft_p95_s if replicas else None
        run.state = {"n": int(number("BATCH_CHUNK", 8)), "ttft_baseline_s": baseline}
        save_concurrency(run.batch.pk, run.state)
    return run.state


def _send(run: Run, lines: list[BatchLine], replicas: list[Replica]) -> list[Outcome]:
    """Send the lines at once. Each result is stored as it comes, well inside the lease,
    not when the chunk's slowest line is done."""
    to = targets(run.batch, run.route, replicas, run.timeout_s)
    outcomes = []
    with ThreadPoolExecutor(max_workers=len(lines)) as pool:
        sends = {pool.submit(to.send, index, line): line for index, line in enumerate(lines)}
        for done in as_completed(sends):
            outcome = done.result()
            record(sends[done], run.worker, outcome)
            outcomes.append(outcome)
    return outcomes


def _learn(run: Run, state: Learnt, replicas: list[Replica], sent: int,
           outcomes: list[Outcome]) -> None:
    """Adapt the concurrency to a round's answers (and, every few seconds, the replicas'
    load), and share it."""
    # "No replica" is not capacity: the pool is waking, the concurrency stays.
    refused = sum(1 for o in outcomes if o.status in (429, 503) and not o.no_replica)
    if run.route is not None and any(o.status is None for o in outcomes):
        run.route_checked = False  # no answer: is the edge still there?
    if replicas and time.monotonic() - run.pressure_at >= run.pressure_every_s:
        run.pressure_at = time.monotonic()
        pressure = replica_pressure(replicas, sent, refused, state["ttft_baseline_s"])
    else:
        pressure = Pressure(sent=sent, refused=refused)
    _adapt(state, pressure, run.limits, run.batch.pk)
    save_concurrency(run.batch.pk, state)


def _idle(batch: Batch) -> float | None:
    """Nothing was due: finish when every line is, else say when the next one is due."""
    left = batch.lines.filter(state__in=[LineState.QUEUED, LineState.RUNNING])
    if not left.exists():
        finalize(batch.pk, BatchStatus.COMPLETED)
        return None
    due = left.filter(state=LineState.QUEUED).aggregate(at=Min("next_attempt_at"))["at"]
    if due is None:
        # Only lines other workers hold: look again when the oldest claim's lease ends
        # (its worker may have died), or at the backoff cap.
        claimed = left.aggregate(at=Min("claimed_at"))["at"]
        if claimed is None:
            return _wait_cap()
        due = claimed + lease()
    return min(_wait_cap(), max(0.0, (due - timezone.now()).total_seconds()))

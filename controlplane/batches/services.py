"""The Batch API's rules: what a valid input file is, creating and cancelling batches, and
running their lines against ready replicas.

Execution: `process()` claims a chunk of lines with `FOR UPDATE SKIP LOCKED` (so several
workers share one batch without sending a line twice) and sends each through an edge at
batch tier (`batch_edge_url`: BATCH_EDGE_URL, else the first enabled edge), with the
batch's own key (`runner_key`: the tenant's identity, its jurisdictions) and
`x-meridian-tier: batch`, so the edge serves interactive requests first. With no edge at
all it posts to a ready replica of the batch's model that the tenant may use (its
jurisdictions and regions; shared deployments or its own). How many lines go at once
adapts (`concurrency`: halved when sends are refused for capacity or the target replicas'
queues, KV cache or TTFT say so, one more otherwise). Each line's result is stored exactly
once with a conditional UPDATE keyed on (batch, custom_id): a line whose result is stored is
never claimed again. 429, 5xx, timeouts and refused connections are retried with
exponential backoff and jitter up to `BATCH_MAX_ATTEMPTS`; other answers are final. When no
line is left the output and error files are written in OpenAI's line format and the batch
completes.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Min, Q
from django.utils import timezone

from controlplane.batches.concurrency import Limits, Pressure, lower_baseline, next_concurrency
from controlplane.batches.errors import BatchError
from controlplane.batches.jsonl import ENDPOINTS, InputLine, InputReader
from controlplane.batches.models import (
    FINISHED,
    Batch,
    BatchFile,
    BatchLine,
    BatchStatus,
    FilePurpose,
    LineState,
)
from controlplane.batches.runner_key import ensure_runner_key, revoke_runner_key
from controlplane.core.models import Tenant, Tier
from controlplane.core.status import redis_client
from controlplane.deployments.models import Deployment, Replica, ReplicaState
from controlplane.routing import cache_salt
from controlplane.routing.models import Edge
from controlplane.telemetry.services import metrics_source

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
METADATA_MAX_KEYS = 16
METADATA_MAX_KEY = 64
METADATA_MAX_VALUE = 512
log = logging.getLogger(__name__)


def _setting(name: str, default: Any) -> Any:
    return getattr(settings, name, default)


def max_file_bytes() -> int:
    return int(_setting("BATCH_FILE_MAX_BYTES", 200 * 1024 * 1024))


def max_file_lines() -> int:
    return int(_setting("BATCH_FILE_MAX_LINES", 50_000))


def max_line_bytes() -> int:
    """The longest line an input file may have: one request, which the edge must carry (its
    own body limit is 8 MiB)."""
    return int(_setting("BATCH_LINE_MAX_BYTES", 8 * 1024 * 1024))


def input_reader() -> InputReader:
    """A reader of one input file's lines, with this deployment's limits."""
    return InputReader(max_file_lines(), max_line_bytes())


def file_too_large(size: int | None = None) -> BatchError:
    """The refusal of a file past BATCH_FILE_MAX_BYTES, naming the cap (413)."""
    seen = f" ({size} bytes)" if size is not None else ""
    return BatchError(f"the file{seen} is larger than {max_file_bytes()} bytes, the most a batch "
                      "input file may have (BATCH_FILE_MAX_BYTES)", status=413, param="file",
                      code="file_too_large")


# Stored files are read back this much at a time: never whole.
STORED_CHUNK_BYTES = 1024 * 1024
# Lines are written to the database this many at a time (or this many bytes' worth).
LINES_PER_INSERT = 2000
BYTES_PER_INSERT = 16 * 1024 * 1024


def stored_chunks(row: BatchFile) -> Iterator[bytes]:
    """A stored file's content, a chunk at a time, straight from Postgres (`substring` of the
    column, which is stored uncompressed so that a slice is read without the rest)."""
    table = BatchFile._meta.db_table
    with connection.cursor() as cursor:
        for offset in range(0, row.bytes, STORED_CHUNK_BYTES):
            cursor.execute(f"SELECT substring(content FROM %s FOR %s) FROM {table} "  # noqa: S608
                           "WHERE id = %s", [offset + 1, STORED_CHUNK_BYTES, row.pk])
            found = cursor.fetchone()
            if found is None:  # deleted meanwhile
                return
            yield bytes(found[0])


def store_file(tenant: Tenant, filename: str, raw: bytes | bytearray, purpose: str,
               line_count: int | None = None) -> BatchFile:
    """A validated input file, written whole in one statement or not at all. `line_count`
    says its lines were checked already, as they arrived (an upload: api.batch_uploads)."""
    if purpose != FilePurpose.BATCH:
        raise BatchError(f"purpose must be \"batch\", not {json.dumps(purpose)}", param="purpose",
                         code="invalid_purpose")
    if len(raw) > max_file_bytes():
        raise file_too_large(len(raw))
    if line_count is None:
        reader = input_reader()
        for start in range(0, len(raw), STORED_CHUNK_BYTES):
            reader.feed(raw[start:start + STORED_CHUNK_BYTES])
        reader.end()
        line_count = reader.lines
    row = BatchFile(tenant=tenant, purpose=purpose, filename=filename[:255], bytes=len(raw),
                    line_count=line_count, created_at=timezone.now())
    # One INSERT with the content as a binary parameter. Through the ORM, psycopg's
    # client-side binding would spell the bytes out in hex inside the statement's text (six
    # times the file in memory); as a binary parameter the driver copies it once.
    fields = [f for f in BatchFile._meta.concrete_fields if f.name != "content"]
    columns = ", ".join(connection.ops.quote_name(str(f.column)) for f in fields)
    values = [f.get_db_prep_save(getattr(row, f.attname), connection) for f in fields]
    connection.ensure_connection()
    with psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(f"INSERT INTO {BatchFile._meta.db_table} ({columns}, content) "  # noqa: S608
                       f"VALUES ({', '.join(['%s'] * len(fields))}, %b)", [*values, raw])
    return row


def delete_file(row: BatchFile) -> None:
    if row.batches.exists():
        batch = row.batches.order_by("created_at").first()
        raise BatchError(f"file {row.id} is the input of {batch.id if batch else 'a batch'}",
                         status=409, param="file_id", code="file_in_use")
    row.delete()


def _usable_deployments(tenant: Tenant, model: str) -> Any:
    return Deployment.objects.filter(served_model_name=model).filter(
        Q(tenant__isnull=True) | Q(tenant=tenant))


def check_model(tenant: Tenant, model: str, allowed_models: Iterable[str] | None) -> None:
    """The model exists for this tenant (shared or its own), its key may use it, and it may be
    served inside the tenant's jurisdictions."""
    deployments = _usable_deployments(tenant, model)
    if not deployments.exists():
        raise BatchError(f"model {json.dumps(model)} does not exist", status=404,
                         param="model", code="model_not_found")
    allowed = list(allowed_models or ["*"])
    if "*" not in allowed and model not in allowed:
        raise BatchError(f"this API key may not use model {json.dumps(model)}", param="model",
                         code="model_not_allowed")
    jurisdictions = list(tenant.allowed_jurisdictions.values_list("pk", flat=True))
    if not deployments.filter(allowed_jurisdictions__in=jurisdictions).exists():
        codes = sorted(tenant.allowed_jurisdictions.values_list("code", flat=True))
        raise BatchError(
            f"model {json.dumps(model)} is not served in the jurisdictions tenant "
            f"{tenant.name} may use ({', '.join(codes) or 'none'})",
            param="model", code="model_not_allowed")


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise BatchError("metadata must be an object of strings", param="metadata")
    if len(metadata) > METADATA_MAX_KEYS:
        raise BatchError(f"metadata has {len(metadata)} keys; at most {METADATA_MAX_KEYS}",
                         param="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_KEY or not isinstance(value, str) \
                or len(value) > METADATA_MAX_VALUE:
            raise BatchError(f"metadata[{json.dumps(key)}] must be a string of at most "
                             f"{METADATA_MAX_VALUE} characters under a key of at most "
                             f"{METADATA_MAX_KEY}", param="metadata")
    return dict(metadata)


def create_batch(tenant: Tenant, input_file_id: Any, endpoint: Any, completion_window: Any,
                 metadata: Any = None, allowed_models: Iterable[str] | None = None) -> Batch:
    """A batch and all its lines, in one transaction, or a BatchError and nothing written."""
    if not isinstance(input_file_id, str) or not input_file_id:
        raise BatchError("input_file_id is required", param="input_file_id")
    if endpoint not in ENDPOINTS:
        raise BatchError(f"endpoint must be one of {', '.join(ENDPOINTS)}, not "
                         f"{json.dumps(endpoint)}", param="endpoint", code="invalid_endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise BatchError(f"completion_window must be \"24h\", not {json.dumps(completion_window)}",
                         param="completion_window")
    clean_metadata = _check_metadata(metadata)
    source = BatchFile.objects.defer("content").filter(tenant=tenant, pk=input_file_id).first()
    if source is None:
        raise BatchError(f"no file {input_file_id}", status=404, param="input_file_id",
                         code="file_not_found")
    if source.purpose != FilePurpose.BATCH:
        raise BatchError(f"file {source.id} has purpose {source.purpose}, not batch",
                         param="input_file_id")
    # The file is read back a chunk at a time and its lines written as they come, inside
    # one transaction: a bad line anywhere leaves nothing written, and memory holds a
    # chunk and the lines not yet written, never the file.
    reader = input_reader()
    chunks = stored_chunks(source)
    lines = _first_lines(reader, chunks)
    if lines[0].url != endpoint:
        raise BatchError(f"line 1: url {lines[0].url} does not match the batch's endpoint "
                         f"{endpoint}", param="endpoint", code="invalid_endpoint")
    model = str(lines[0].body["model"])
    check_model(tenant, model, allowed_models)
    now = timezone.now()
    with transaction.atomic():
        batch = Batch.objects.create(
            tenant=tenant, input_file=source, endpoint=endpoint, model=model,
            completion_window=completion_window, metadata=clean_metadata,
            expires_at=now + COMPLETION_WINDOWS[completion_window])
        _write_lines(batch, lines, reader, chunks)
    return batch


def _first_lines(reader: InputReader, chunks: Iterator[bytes]) -> list[InputLine]:
    """Read until the first line is known (a BatchError for a file without one)."""
    for chunk in chunks:
        lines = reader.feed(chunk)
        if lines:
            return lines
    return reader.end()


def _write_lines(batch: Batch, lines: list[InputLine], reader: InputReader,
                 chunks: Iterator[bytes]) -> None:
    """Write `lines`, then every line left in `chunks`, a few thousand at a time."""
    fed = reader.size

    def write(pending: list[InputLine]) -> None:
        BatchLine.objects.bulk_create(
            [BatchLine(batch=batch, line_number=line.number, custom_id=line.custom_id,
                       body=line.body) for line in pending])

    for chunk in chunks:
        lines += reader.feed(chunk)
        if len(lines) >= LINES_PER_INSERT or reader.size - fed >= BYTES_PER_INSERT:
            write(lines)
            lines, fed = [], reader.size
    write(lines + reader.end())


def request_counts(batch: Batch) -> dict[str, int]:
    counts = dict(batch.lines.values_list("state").annotate(n=Count("id")).order_by())
    return {"total": sum(counts.values()), "completed": counts.get(LineState.DONE, 0),
            "failed": counts.get(LineState.FAILED, 0)}


def cancel_batch(batch_id: str) -> Batch:
    """Stops new sends; results already stored stay and go to the output file. Finished
    batches refuse (409)."""
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(pk=batch_id)
        if batch.status in FINISHED:
            raise BatchError(f"batch {batch.id} is already {batch.status}", status=409,
                             param="batch_id", code="batch_finished")
        if batch.status != BatchStatus.CANCELLING:
            batch.status = BatchStatus.CANCELLING
            batch.cancelling_at = timezone.now()
            batch.save(update_fields=["status", "cancelling_at"])
    if not _running(batch).exists():
        finalize(batch.pk, BatchStatus.CANCELLED)
    batch.refresh_from_db()
    return batch


# -- execution -------------------------------------------------------------------------------


def _lease() -> timedelta:
    return timedelta(seconds=float(_setting("BATCH_LEASE_S", 600)))


def _running(batch: Batch) -> Any:
    """Lines a live worker holds (a claim older than the lease belongs to a dead one)."""
    return batch.lines.filter(state=LineState.RUNNING,
                              claimed_at__gte=timezone.now() - _lease())


def claim(batch: Batch, worker: str, size: int) -> list[BatchLine]:
    """Up to `size` lines due now (queued, or held past the lease by a worker that died),
    locked with SKIP LOCKED so concurrent workers take different lines."""
    now = timezone.now()
    due = Q(state=LineState.QUEUED) & (Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now))
    stale = Q(state=LineState.RUNNING, claimed_at__lt=now - _lease())
    with transaction.atomic():
        ids = list(BatchLine.objects.select_for_update(skip_locked=True)
                   .filter(batch=batch).filter(due | stale)
                   .order_by("line_number").values_list("pk", flat=True)[:size])
        BatchLine.objects.filter(pk__in=ids).update(
            state=LineState.RUNNING, claimed_at=now, worker=worker, attempts=F("attempts") + 1)
    return list(BatchLine.objects.filter(pk__in=ids).order_by("line_number"))


@dataclass(frozen=True)
class Outcome:
    """What one send produced: an HTTP answer (`status`, `body`) or a transport failure."""

    status: int | None
    body: Any
    request_id: str
    retry_after_s: float | None = None
    error: str = ""

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status == 429 or self.status >= 500

    @property
    def no_replica(self) -> bool:
        """The edge's 503 for a model with no replica serving (a batch pool scaled to zero,
        or one still starting): not an attempt, the line waits for the pool to wake."""
        if self.status != 503 or not isinstance(self.body, dict):
            return False
        error = self.body.get("error")
        return isinstance(error, dict) and error.get("code") == NO_REPLICA_CODE


def has_batch_pool(batch: Batch) -> bool:
    """Whether the batch's model has a batch-tier deployment the tenant may use (shared or
    its own): then its lines go to that deployment's replicas alone, as the edges' tables
    say (`batch_pool`), and while it has none they wake it."""
    return _usable_deployments(batch.tenant, batch.model).filter(tier=Tier.BATCH).exists()


def eligible_replicas(batch: Batch, pool: bool = False) -> list[Replica]:
    """Ready replicas of the batch's model the tenant may use: shared or its own
    deployments, inside its jurisdictions (and its regions, where it names any); with
    `pool`, those of its batch-tier deployments only."""
    tenant = batch.tenant
    rows = Replica.objects.filter(
        state=ReplicaState.READY, deployment__served_model_name=batch.model,
        region__jurisdiction__in=tenant.allowed_jurisdictions.all(),
    ).filter(Q(deployment__tenant__isnull=True) | Q(deployment__tenant=tenant)).exclude(
        url="").select_related("deployment")
    if pool:
        rows = rows.filter(deployment__tier=Tier.BATCH)
    if tenant.allowed_regions.exists():
        rows = rows.filter(region__in=tenant.allowed_regions.all())
    return list(rows)


# How soon a batch looks again at an edge that could not take its lines.
EDGE_RECHECK_S = 1.0
# The edge's error code when no replica of a model serves (edge.errors.NO_PICK).
NO_REPLICA_CODE = "no_replicas"


def wake_recheck_s() -> float:
    """How soon a line the edge answered "no replica" is sent again: while a batch pool
    wakes, one send this often keeps the edges counting the demand that wakes it."""
    return float(_setting("BATCH_WAKE_RECHECK_S", 2.0))


def batch_edge_url() -> str | None:
    """The edge lines are sent through: BATCH_EDGE_URL, else the first enabled edge with a
    public URL (the lab's first edge); None: no edge, lines go straight to replicas."""
    configured = _setting("BATCH_EDGE_URL", None)
    if configured:
        return str(configured).rstrip("/")
    edge = Edge.objects.filter(enabled=True).exclude(public_url="").order_by("pk").first()
    return edge.public_url.rstrip("/") if edge is not None else None


@dataclass(frozen=True)
class EdgeRoute:
    """Sending a batch's lines through an edge: where, and the headers that say who at which
    tier."""

    url: str
    headers: dict[str, str]


def edge_route(batch: Batch) -> EdgeRoute | None:
    base = batch_edge_url()
    if base is None:
        return None
    return EdgeRoute(base, {"Authorization": f"Bearer {ensure_runner_key(batch)}",
                            "x-meridian-tier": "batch"})


def edge_unready(route: EdgeRoute, timeout_s: float = 5.0) -> str:
    """Why the edge cannot take the batch's lines now, or "" when it can: it does not answer
    (down, restarting), it has no table yet (503), or it refuses the batch's key (its table
    does not hold it yet: a new key reaches the edges with the next table). Any other answer is left to the sends and
    their retries."""
    request = urllib.request.Request(route.url + "/v1/models", headers=route.headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return ""
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            return "the edge does not know the batch's key yet"
        if exc.code == 503:  # no routing table yet (starting): it would refuse every line
            return f"the edge at {route.url} cannot route yet (503)"
        return ""
    except (TimeoutError, OSError) as exc:  # URLError is an OSError
        return f"the edge at {route.url} does not answer ({exc})"


def send(url: str, body: dict[str, Any], timeout_s: float,
         headers: dict[str, str] | None = None, request_id: str = "") -> Outcome:
    request_id = request_id or "req_" + secrets.token_hex(12)
    request = urllib.request.Request(
        url, data=json.dumps({**body, "stream": False}).encode(), method="POST",
        headers={"Content-Type": "application/json", "x-request-id": request_id,
                 **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return Outcome(response.status, _json(response.read()), request_id)
    except urllib.error.HTTPError as exc:
        retry_after = exc.headers.get("Retry-After") if exc.headers else None
        try:
            wait = float(retry_after) if retry_after else None
        except ValueError:
            wait = None
        return Outcome(exc.code, _json(exc.read()), request_id, retry_after_s=wait)
    except (TimeoutError, OSError) as exc:  # URLError is an OSError
        return Outcome(None, None, request_id, error=f"{type(exc).__name__}: {exc}")


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return {"raw": raw.decode("utf-8", "replace")[:2000]}


def backoff_s(attempt: int, retry_after_s: float | None = None) -> float:
    """Exponential with jitter: half the step fixed, half random; never below Retry-After."""
    base = float(_setting("BATCH_BACKOFF_BASE_S", 1.0))
    cap = float(_setting("BATCH_BACKOFF_MAX_S", 60.0))
    step = min(cap, base * 2 ** max(0, attempt - 1))
    delay = step / 2 + random.uniform(0, step / 2)
    return max(delay, retry_after_s or 0.0)


def record(line: BatchLine, worker: str, outcome: Outcome) -> bool:
    """Store a line's outcome once. Success or a final failure is written by an UPDATE that
    only matches while the line has no stored result and this worker still holds it; a
    retryable failure puts it back in the queue with a backoff, unless its attempts are
    spent. True when this call wrote.

    A worker whose lease ran out may find its lines claimed again by another: it stores
    nothing for them, the other worker's send does. Storing it anyway would race that
    claim, and the other worker would send a line whose result was already stored."""
    now = timezone.now()
    max_attempts = int(_setting("BATCH_MAX_ATTEMPTS", 5))
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
    cutoff = timezone.now() - timedelta(seconds=float(_setting("BATCH_STALL_S", 300)))
    rows = (Batch.objects.exclude(status__in=FINISHED).filter(created_at__lt=cutoff)
            .filter(Q(last_run_at__isnull=True) | Q(last_run_at__lt=cutoff)))
    return list(rows.order_by("created_at").values_list("pk", flat=True))


def _start(batch: Batch) -> None:
    Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
        status=BatchStatus.IN_PROGRESS, in_progress_at=timezone.now())


def send_id(line: BatchLine) -> str:
    """The request id of one send of a line: its batch, line and attempt (what an audit of
    the edges' and engines' logs matches sends by)."""
    return f"req_{line.batch_id.removeprefix('batch_')}_{line.line_number}_{line.attempts}"


def concurrency_limits() -> Limits:
    return Limits(floor=1, ceiling=int(_setting("BATCH_MAX_CONCURRENCY", 64)))


def _concurrency_key(batch_id: str) -> str:
    return f"meridian:batches:concurrency:{batch_id}"


def load_concurrency(batch_id: str) -> dict[str, Any] | None:
    """What the batch's runners learnt so far (the number, the TTFT baseline), shared in
    Redis so that a worker that starts again, or another one, goes on from it; None when
    nothing is kept (or Redis cannot be read: the runner starts afresh)."""
    try:
        raw: Any = redis_client().get(_concurrency_key(batch_id))
    except Exception:  # noqa: BLE001 - a cache: the batch runs without it
        log.warning("cannot read batch %s's concurrency", batch_id, exc_info=True)
        return None
    return json.loads(raw) if raw else None


def save_concurrency(batch_id: str, state: dict[str, Any] | None) -> None:
    try:
        client = redis_client()
        if state is None:
            client.delete(_concurrency_key(batch_id))
        else:
            client.set(_concurrency_key(batch_id), json.dumps(state), ex=24 * 3600)
    except Exception:  # noqa: BLE001 - a cache: the batch runs without it
        log.warning("cannot keep batch %s's concurrency", batch_id, exc_info=True)


def replica_pressure(replicas: list[Replica], sent: int, refused: int,
                     baseline_s: float | None) -> Pressure:
    """A round's answers and the target replicas' latest load, as AIMD reads them."""
    stats = metrics_source().replica_stats({str(r.pk): r.url for r in replicas},
                                           window_s=int(_setting("BATCH_PRESSURE_WINDOW_S", 15)))
    live = [s for s in stats.values() if s.up]
    ttfts = [s.ttft_p95_s for s in live if s.ttft_p95_s is not None]
    return Pressure(sent=sent, refused=refused,
                    waiting=max((s.waiting for s in live), default=0.0),
                    kv_usage=max((s.kv_usage for s in live), default=0.0),
                    ttft_p95_s=max(ttfts) if ttfts else None, ttft_baseline_s=baseline_s)


def _adapt(state: dict[str, Any], pressure: Pressure, limits: Limits, batch_id: str) -> None:
    state["n"], why = next_concurrency(state["n"], pressure, limits)
    if why:
        log.info("batch %s: concurrency %d (%s)", batch_id, state["n"], why)
    state["ttft_baseline_s"] = lower_baseline(state["ttft_baseline_s"], pressure.ttft_p95_s)


def process(batch_id: str, worker: str, budget_s: float = 30.0) -> float | None:
    """Run a batch's due lines for about `budget_s`. None: the batch is finished (or was);
    a number: seconds until a line is next due, for the caller to come back then."""
    batch = Batch.objects.select_related("tenant").get(pk=batch_id)
    if batch.status in FINISHED:
        return None
    _start(batch)
    Batch.objects.filter(pk=batch.pk).update(last_run_at=timezone.now())
    timeout_s = float(_setting("BATCH_REQUEST_TIMEOUT_S", 120.0))
    limits = concurrency_limits()
    # What the batch's runners learnt so far, or BATCH_CHUNK to begin with.
    state = load_concurrency(batch.pk)
    route = edge_route(batch)
    route_checked = False
    pooled = has_batch_pool(batch)
    # The replicas' load is read every few seconds (telemetry is sampled no faster); each
    # round's answers count every round.
    pressure_every_s = float(_setting("BATCH_PRESSURE_EVERY_S", 5.0))
    pressure_at = time.monotonic()
    started = timezone.now()
    while True:
        batch.refresh_from_db(fields=["status"])
        if batch.status == BatchStatus.CANCELLING:
            if _running(batch).exists():
                return _wait_cap()
            finalize(batch.pk, BatchStatus.CANCELLED)
            return None
        if batch.status in FINISHED:
            return None
        if timezone.now() >= batch.expires_at:
            finalize(batch.pk, BatchStatus.EXPIRED)
            return None
        replicas = eligible_replicas(batch, pooled)
        # A batch pool with no replica (scaled to zero) is woken by the edge: it counts the
        # requests it could not route, and the autoscaler brings the pool up on them. So
        # one line at a time is sent, and its "no replica" answer is not an attempt.
        waking = not replicas and pooled and route is not None
        if not replicas and not waking:
            # Nothing to send to (a region down, replicas still starting): no line is
            # claimed and no attempt spent; the batch waits, until its window ends.
            wait = _idle(batch)
            return None if wait is None else _wait_cap()
        if route is not None and not route_checked:
            # As with no replica: while the edge cannot take lines none is claimed and no
            # attempt spent, so an edge restarting does not use up the lines' attempts.
            why = edge_unready(route)
            if why:
                log.info("batch %s waits: %s", batch.pk, why)
                return min(_wait_cap(), EDGE_RECHECK_S)
            route_checked = True
        if state is None:
            # Before the batch's first send: the replicas' TTFT without it is the baseline
            # a rise is measured against.
            state = {"n": int(_setting("BATCH_CHUNK", 8)),
                     "ttft_baseline_s": (replica_pressure(replicas, 0, 0, None).ttft_p95_s
                                         if replicas else None)}
            save_concurrency(batch.pk, state)
        lines = claim(batch, worker, 1 if waking else state["n"])
        if not lines:
            return _idle(batch)

        isolated = {r.pk for r in replicas if cache_salt.cache_isolated(r)}
        salt = cache_salt.tenant_cache_salt(batch.tenant_id) if isolated and route is None \
            else ""

        def run(item: tuple[int, BatchLine], _replicas: list[Replica] = replicas,
                _isolated: set[int] = isolated, _salt: str = salt) -> Outcome:
            index, line = item
            if route is not None:
                return send(route.url + batch.endpoint, line.body, timeout_s, route.headers,
                            send_id(line))
            replica = _replicas[(index + random.randrange(len(_replicas))) % len(_replicas)]
            # Past the edges, the tenant's prefix-cache salt is the runner's to add.
            body = cache_salt.salted(line.body, _salt) if replica.pk in _isolated else line.body
            return send(replica.url.rstrip("/") + batch.endpoint, body, timeout_s,
                        request_id=send_id(line))

        outcomes = []
        with ThreadPoolExecutor(max_workers=len(lines)) as pool:
            # Each result is stored as it comes, well inside the lease, not when the
            # chunk's slowest line is done.
            sends = {pool.submit(run, item): item[1] for item in enumerate(lines)}
            for done in as_completed(sends):
                outcome = done.result()
                record(sends[done], worker, outcome)
                outcomes.append(outcome)
        if waking and all(o.no_replica for o in outcomes):
            return wake_recheck_s()  # still waking: come back, holding the rest unclaimed
        # "No replica" is not capacity: the pool is waking, the concurrency stays.
        refused = sum(1 for o in outcomes if o.status in (429, 503) and not o.no_replica)
        if route is not None and any(o.status is None for o in outcomes):
            route_checked = False  # no answer: is the edge still there?
        if replicas and time.monotonic() - pressure_at >= pressure_every_s:
            pressure_at = time.monotonic()
            pressure = replica_pressure(replicas, len(lines), refused,
                                        state["ttft_baseline_s"])
        else:
            pressure = Pressure(sent=len(lines), refused=refused)
        _adapt(state, pressure, limits, batch.pk)
        save_concurrency(batch.pk, state)
        if (timezone.now() - started).total_seconds() >= budget_s:
            return 0.0


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
        due = claimed + _lease()
    return min(_wait_cap(), max(0.0, (due - timezone.now()).total_seconds()))


def _wait_cap() -> float:
    """The longest a runner waits between runs of a batch: the backoff cap."""
    return float(_setting("BATCH_BACKOFF_MAX_S", 60.0))


def _output_line(line: BatchLine) -> dict[str, Any]:
    response = None
    if line.response_status is not None and line.result is not None:
        response = {"status_code": line.response_status, "request_id": line.request_id,
                    "body": line.result}
    return {"id": f"batch_req_{line.batch_id.removeprefix('batch_')}_{line.line_number}",
            "custom_id": line.custom_id, "response": response,
            "error": None if line.state == LineState.DONE else line.error}


def _jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(row, separators=(",", ":")).encode() + b"\n" for row in rows)


def finalize(batch_id: str, status: str) -> Batch:
    """Write the output and error files and end the batch, once: a finished batch is left
    as it is. Expired batches list their unsent lines in the error file; cancelled ones do
    not (as OpenAI's)."""
    now = timezone.now()
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(pk=batch_id)
        if batch.status in FINISHED:
            return batch
        batch.finalizing_at = batch.finalizing_at or now
        if status == BatchStatus.EXPIRED:
            batch.lines.filter(state__in=[LineState.QUEUED, LineState.RUNNING]).update(
                state=LineState.FAILED, finished_at=now,
                error={"code": "batch_expired",
                       "message": "This request could not be executed before the completion "
                                  "window expired."})
        done = batch.lines.filter(state=LineState.DONE).order_by("line_number")
        failed = batch.lines.filter(state=LineState.FAILED).order_by("line_number")
        batch.output_file = _result_file(batch, "output", done)
        batch.error_file = _result_file(batch, "errors", failed)
        batch.status = status
        stamp = {BatchStatus.COMPLETED: "completed_at", BatchStatus.EXPIRED: "expired_at",
                 BatchStatus.CANCELLED: "cancelled_at", BatchStatus.FAILED: "failed_at"}[
            BatchStatus(status)]
        setattr(batch, stamp, now)
        batch.save()
    revoke_runner_key(batch.pk)
    save_concurrency(batch.pk, None)
    return batch


def _result_file(batch: Batch, kind: str, lines: Any) -> BatchFile | None:
    rows = [_output_line(line) for line in lines]
    if not rows:
        return None
    content = _jsonl(rows)
    return BatchFile.objects.create(
        tenant_id=batch.tenant_id, purpose=FilePurpose.BATCH_OUTPUT,
        filename=f"{batch.id}_{kind}.jsonl", bytes=len(content), line_count=len(rows),
        content=content)

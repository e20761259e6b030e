"""A batch's intake: what a valid input file and batch request are, storing input files,
creating a batch with all its lines, and cancelling one.

A request to create a batch arrives as a `BatchRequest`, checked field by field as it is
made (`BatchRequest.from_body` reads one from the API's JSON). `create_batch` reads the
input file back a chunk at a time and writes its lines as they come, inside one
transaction: a bad line anywhere leaves nothing written.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import psycopg
from django.db import connection, transaction
from django.utils import timezone

from controlplane.batches.config import number
from controlplane.batches.errors import BatchError
from controlplane.batches.jsonl import ENDPOINTS, InputLine, InputReader
from controlplane.batches.lease import held
from controlplane.batches.models import (
    FINISHED,
    Batch,
    BatchFile,
    BatchLine,
    BatchStatus,
    FilePurpose,
)
from controlplane.batches.results import finalize
from controlplane.core.models import Tenant
from controlplane.deployments.models import Deployment

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
METADATA_MAX_KEYS = 16
METADATA_MAX_KEY = 64
METADATA_MAX_VALUE = 512
# Stored files are read back this much at a time: never whole.
STORED_CHUNK_BYTES = 1024 * 1024
# Lines are written to the database this many at a time (or this many bytes' worth).
LINES_PER_INSERT = 2000
BYTES_PER_INSERT = 16 * 1024 * 1024


def max_file_bytes() -> int:
    return int(number("BATCH_FILE_MAX_BYTES", 200 * 1024 * 1024))


def max_file_lines() -> int:
    return int(number("BATCH_FILE_MAX_LINES", 50_000))


def max_line_bytes() -> int:
    """The longest line an input file may have: one request, which the edge must carry (its
    own body limit is 8 MiB)."""
    return int(number("BATCH_LINE_MAX_BYTES", 8 * 1024 * 1024))


def input_reader() -> InputReader:
    """A reader of one input file's lines, with this deployment's limits."""
    return InputReader(max_file_lines(), max_line_bytes())


def file_too_large(size: int | None = None) -> BatchError:
    """The refusal of a file past BATCH_FILE_MAX_BYTES, naming the cap (413)."""
    seen = f" ({size} bytes)" if size is not None else ""
    return BatchError(f"the file{seen} is larger than {max_file_bytes()} bytes, the most a batch "
                      "input file may have (BATCH_FILE_MAX_BYTES)", status=413, param="file",
                      code="file_too_large")


# -- input files ------------------------------------------------------------------------------


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


# -- the request ------------------------------------------------------------------------------


def _input_file_id(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise BatchError("input_file_id is required", param="input_file_id")
    return value


def _endpoint(value: object) -> str:
    if not isinstance(value, str) or value not in ENDPOINTS:
        raise BatchError(f"endpoint must be one of {', '.join(ENDPOINTS)}, not "
                         f"{json.dumps(value)}", param="endpoint", code="invalid_endpoint")
    return value


def _completion_window(value: object) -> str:
    if not isinstance(value, str) or value not in COMPLETION_WINDOWS:
        raise BatchError(f"completion_window must be \"24h\", not {json.dumps(value)}",
                         param="completion_window")
    return value


def _metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BatchError("metadata must be an object of strings", param="metadata")
    if len(value) > METADATA_MAX_KEYS:
        raise BatchError(f"metadata has {len(value)} keys; at most {METADATA_MAX_KEYS}",
                         param="metadata")
    for key, item in value.items():
        if len(key) > METADATA_MAX_KEY or not isinstance(item, str) \
                or len(item) > METADATA_MAX_VALUE:
            raise BatchError(f"metadata[{json.dumps(key)}] must be a string of at most "
                             f"{METADATA_MAX_VALUE} characters under a key of at most "
                             f"{METADATA_MAX_KEY}", param="metadata")
    return dict(value)


@dataclass(frozen=True)
class BatchRequest:
    """A request to create a batch: its input file, the endpoint its lines call, its
    completion window and its metadata. Checked as it is made: a BatchError names the first
    field at fault."""

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None

    def __post_init__(self) -> None:
        _input_file_id(self.input_file_id)
        _endpoint(self.endpoint)
        _completion_window(self.completion_window)
        _metadata(self.metadata)

    @classmethod
    def from_body(cls, body: Mapping[str, object]) -> BatchRequest:
        """The request in the JSON object of POST /v1/batches."""
        return cls(_input_file_id(body.get("input_file_id")), _endpoint(body.get("endpoint")),
                   _completion_window(body.get("completion_window")),
                   _metadata(body.get("metadata")))


# -- creating and cancelling ------------------------------------------------------------------


def check_model(tenant: Tenant, model: str, allowed_models: Iterable[str] | None) -> None:
    """The model exists for this tenant (shared or its own), its key may use it, and it may be
    served inside the tenant's jurisdictions."""
    deployments = Deployment.objects.usable_by(tenant.pk).filter(served_model_name=model)
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


def _input_file(tenant: Tenant, file_id: str) -> BatchFile:
    source = BatchFile.objects.defer("content").filter(tenant=tenant, pk=file_id).first()
    if source is None:
        raise BatchError(f"no file {file_id}", status=404, param="input_file_id",
                         code="file_not_found")
    if source.purpose != FilePurpose.BATCH:
        raise BatchError(f"file {source.id} has purpose {source.purpose}, not batch",
                         param="input_file_id")
    return source


def create_batch(tenant: Tenant, request: BatchRequest,
                 allowed_models: Iterable[str] | None = None) -> Batch:
    """A batch and all its lines, in one transaction, or a BatchError and nothing written.
    `allowed_models`: what the caller's key may use (None: any)."""
    source = _input_file(tenant, request.input_file_id)
    # The file is read back a chunk at a time and its lines written as they come, inside
    # one transaction: a bad line anywhere leaves nothing written, and memory holds a
    # chunk and the lines not yet written, never the file.
    reader = input_reader()
    chunks = stored_chunks(source)
    lines = _first_lines(reader, chunks)
    if lines[0].url != request.endpoint:
        raise BatchError(f"line 1: url {lines[0].url} does not match the batch's endpoint "
                         f"{request.endpoint}", param="endpoint", code="invalid_endpoint")
    model = str(lines[0].body["model"])
    check_model(tenant, model, allowed_models)
    now = timezone.now()
    with transaction.atomic():
        batch = Batch.objects.create(
            tenant=tenant, input_file=source, endpoint=request.endpoint, model=model,
            completion_window=request.completion_window, metadata=request.metadata,
            expires_at=now + COMPLETION_WINDOWS[request.completion_window])
        _write_lines(batch, lines, reader, chunks)
    return batch


def _first_lines(reader: InputReader, chunks: Iterator[bytes]) -> list[InputLine]:
    """Read until the first line is known (a BatchError for a file without one)."""
    for chunk in chunks:
        lines = reader.feed(chunk)
        if lines:
            return lines
    return reader.end()


def _insert_lines(batch: Batch, lines: list[InputLine]) -> None:
    BatchLine.objects.bulk_create(
        [BatchLine(batch=batch, line_number=line.number, custom_id=line.custom_id,
                   body=line.body) for line in lines])


def _write_lines(batch: Batch, lines: list[InputLine], reader: InputReader,
                 chunks: Iterator[bytes]) -> None:
    """Write `lines`, then every line left in `chunks`, a few thousand at a time."""
    fed = reader.size
    for chunk in chunks:
        lines += reader.feed(chunk)
        if len(lines) >= LINES_PER_INSERT or reader.size - fed >= BYTES_PER_INSERT:
            _insert_lines(batch, lines)
            lines, fed = [], reader.size
    _insert_lines(batch, lines + reader.end())


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
    if not batch.lines.filter(held(timezone.now())).exists():
        finalize(batch.pk, BatchStatus.CANCELLED)
    batch.refresh_from_db()
    return batch

"""OpenAI's Files and Batches endpoints under /v1/ (not /api/v1/): the shapes the official
`openai` package reads, authenticated with the tenant's inference key (`Authorization:
Bearer sk-mrd-…`, matched by its SHA-256 like the edges do), errors as
`{"error": {"message", "type", "param", "code"}}`.

Plain Django views rather than DRF: the wire format is OpenAI's, not the REST API's, and
they stay out of the /api/ schema (and its fuzzing), which describes the operators' API.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime
from functools import wraps
from typing import Any

from django.db.models import Q
from django.http import (
    HttpRequest,
    HttpResponse,
    JsonResponse,
    StreamingHttpResponse,
    UnreadablePostError,
)
from django.http.multipartparser import MultiPartParserError
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from controlplane.api.batch_uploads import BatchUploadHandler, CheckedUpload
from controlplane.batches import audit, intake, progress, tasks
from controlplane.batches.cost import batch_cost, cost_json
from controlplane.batches.errors import BatchError
from controlplane.batches.models import Batch, BatchFile, FilePurpose
from controlplane.core.hashing import sha256_hex
from controlplane.core.models import ApiKey

View = Callable[..., HttpResponseBase]
log = logging.getLogger(__name__)


def error(message: str, status: int, *, param: str | None = None, code: str | None = None,
          kind: str = "invalid_request_error") -> JsonResponse:
    return JsonResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status=status)


def _key(request: HttpRequest) -> ApiKey | None:
    scheme, _, secret = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        return None
    return ApiKey.objects.select_related("tenant").filter(
        key_hash=sha256_hex(secret.strip()), revoked_at__isnull=True).first()


def inference_api(methods: tuple[str, ...]) -> Callable[[View], View]:
    """Checks the method and the key, passes the key on, answers BatchError in OpenAI's
    shape. What the view changes is audited as the key's (`audit.api_actor`)."""

    def wrap(view: View) -> View:
        @csrf_exempt
        @wraps(view)
        def handler(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if request.method not in methods:
                return error(f"{request.method} is not allowed here", 405,
                             code="method_not_allowed")
            key = _key(request)
            if key is None:
                return error("Incorrect API key provided.", 401, code="invalid_api_key")
            try:
                if request.method == "GET":  # reads change nothing
                    return view(request, key, *args, **kwargs)
                with audit.acting_as(audit.api_actor(key.tenant.name, key.name)):
                    return view(request, key, *args, **kwargs)
            except BatchError as exc:
                return error(exc.message, exc.status, param=exc.param, code=exc.code,
                             kind=exc.kind)

        return handler

    return wrap


def _ts(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


def file_object(row: BatchFile) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": _ts(row.created_at),
            "filename": row.filename, "purpose": row.purpose, "status": "processed",
            "status_details": None}


def batch_object(batch: Batch) -> dict[str, Any]:
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
        "errors": None if not batch.errors else {"object": "list", "data": batch.errors},
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": batch.status, "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id, "model": batch.model,
        "created_at": _ts(batch.created_at), "in_progress_at": _ts(batch.in_progress_at),
        "expires_at": _ts(batch.expires_at), "finalizing_at": _ts(batch.finalizing_at),
        "completed_at": _ts(batch.completed_at), "failed_at": _ts(batch.failed_at),
        "expired_at": _ts(batch.expired_at), "cancelling_at": _ts(batch.cancelling_at),
        "cancelled_at": _ts(batch.cancelled_at),
        "request_counts": progress.request_counts(batch), "metadata": batch.metadata,
    }


def _file(key: ApiKey, file_id: str) -> BatchFile:
    row = BatchFile.objects.defer("content").filter(tenant=key.tenant, pk=file_id).first()
    if row is None:
        raise BatchError(f"No such File object: {file_id}", status=404, param="id",
                         code="file_not_found")
    return row


def _batch(key: ApiKey, batch_id: str) -> Batch:
    row = Batch.objects.filter(tenant=key.tenant, pk=batch_id).first()
    if row is None:
        raise BatchError(f"No such Batch object: {batch_id}", status=404, param="id",
                         code="batch_not_found")
    return row


def _limit(request: HttpRequest, default: int = 20) -> int:
    raw = request.GET.get("limit", str(default))
    try:
        limit = int(raw)
    except ValueError:
        raise BatchError(f"limit must be an integer, not {json.dumps(raw)}",
                         param="limit") from None
    if not 1 <= limit <= 100:
        raise BatchError("limit must be between 1 and 100", param="limit")
    return limit


def _page(rows: Any, request: HttpRequest, render: Callable[[Any], dict[str, Any]]) -> JsonResponse:
    """Newest first; `after` is the id of the last object of the previous page."""
    limit = _limit(request)
    after = request.GET.get("after")
    if after:
        anchor = rows.filter(pk=after).first()
        if anchor is None:
            raise BatchError(f"after: no such object {after}", status=404, param="after")
        rows = rows.filter(Q(created_at__lt=anchor.created_at)
                           | Q(created_at=anchor.created_at, pk__lt=anchor.pk))
    page = list(rows.order_by("-created_at", "-pk")[:limit + 1])
    data = [render(row) for row in page[:limit]]
    return JsonResponse({"object": "list", "data": data,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None,
                         "has_more": len(page) > limit})


@inference_api(("GET", "POST"))
def files(request: HttpRequest, key: ApiKey) -> HttpResponse:
    if request.method == "GET":
        rows = BatchFile.objects.defer("content").filter(tenant=key.tenant)
        if request.GET.get("purpose"):
            rows = rows.filter(purpose=request.GET["purpose"])
        return _page(rows, request, file_object)
    # The file is checked and capped while it streams in (api.batch_uploads).
    handler = BatchUploadHandler(request)
    request.upload_handlers = [handler]
    try:
        upload = request.FILES.get("file")
    except (UnreadablePostError, MultiPartParserError) as exc:
        if handler.late:
            raise handler.too_slow() from None
        raise BatchError(f"the upload could not be read: {exc}", param="file") from None
    finally:
        handler.stop_watching()
    if handler.late:
        raise handler.too_slow()
    if not isinstance(upload, CheckedUpload):
        raise BatchError("a multipart field 'file' is required", param="file")
    purpose = request.POST.get("purpose", "")
    if purpose != FilePurpose.BATCH:
        raise BatchError(f"purpose must be \"batch\", not {json.dumps(purpose)}",
                         param="purpose", code="invalid_purpose")
    row = intake.store_file(key.tenant, upload.name or "input.jsonl", upload.content, purpose,
                              upload.line_count)
    return JsonResponse(file_object(row))


@inference_api(("GET", "DELETE"))
def file_detail(request: HttpRequest, key: ApiKey, file_id: str) -> HttpResponse:
    row = _file(key, file_id)
    if request.method == "DELETE":
        intake.delete_file(row)
        return JsonResponse({"id": file_id, "object": "file", "deleted": True})
    return JsonResponse(file_object(row))


@inference_api(("GET",))
def file_content(request: HttpRequest, key: ApiKey, file_id: str) -> StreamingHttpResponse:
    row = _file(key, file_id)
    # Sent a chunk at a time from the database, never held whole.
    response = StreamingHttpResponse(intake.stored_chunks(row),
                                     content_type="application/jsonl")
    response["Content-Length"] = str(row.bytes)
    return response


@inference_api(("GET", "POST"))
def batches(request: HttpRequest, key: ApiKey) -> HttpResponse:
    if request.method == "GET":
        return _page(Batch.objects.filter(tenant=key.tenant), request, batch_object)
    try:
        body = json.loads(request.body or b"{}")
    except ValueError as exc:
        raise BatchError(f"the request body is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BatchError("the request body must be a JSON object")
    batch = intake.create_batch(key.tenant, intake.BatchRequest.from_body(body),
                                key.allowed_models)
    try:
        tasks.run_batch.delay(batch.id)
    except Exception:  # the broker is away: the batch is stored, and the sweep will run it
        log.warning("could not queue batch %s; batches.sweep will", batch.id, exc_info=True)
    return JsonResponse(batch_object(batch))


def batch_answer(batch: Batch) -> dict[str, Any]:
    """OpenAI's batch object with its `usage`, and what Meridian adds under `meridian` (the
    cost: see batches.cost), which OpenAI's clients leave alone. The usage and the cost's
    tokens are one sum of the finished lines' usage."""
    cost = batch_cost(batch)
    return {**batch_object(batch), "usage": cost.usage.as_openai(),
            "meridian": {"cost": cost_json(cost)}}


@inference_api(("GET",))
def batch_detail(request: HttpRequest, key: ApiKey, batch_id: str) -> HttpResponse:
    return JsonResponse(batch_answer(_batch(key, batch_id)))


@inference_api(("POST",))
def batch_cancel(request: HttpRequest, key: ApiKey, batch_id: str) -> HttpResponse:
    batch = intake.cancel_batch(_batch(key, batch_id).pk)
    return JsonResponse(batch_object(batch))

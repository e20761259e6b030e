"""Batch input files in bounded memory: an upload is capped while it streams in (413 naming the
cap, the rest never read, nothing stored, no temporary file), its lines are checked as they
arrive with a per-line cap, and a stored file is read back and turned into a batch a chunk
at a time, with a bad line anywhere leaving nothing written."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from django.core.handlers.wsgi import WSGIRequest
from django.test import Client, RequestFactory
from django.test.client import encode_multipart

from controlplane.api import batch_views
from controlplane.api.batch_uploads import BatchUploadHandler
from controlplane.batches import intake
from controlplane.batches.errors import BatchError
from controlplane.batches.models import Batch, BatchFile, BatchLine

from .conftest import jsonl, line

pytestmark = pytest.mark.django_db
BOUNDARY = "BoUnDaRyBoUnDaRy"


class CountingInput(io.BytesIO):
    """A request body that counts how much of it the server read."""

    taken = 0

    def read(self, size: int | None = -1) -> bytes:
        piece = super().read(size)
        self.taken += len(piece)
        return piece


def upload_request(key: str, content: bytes,
                   purpose: str = "batch") -> tuple[WSGIRequest, CountingInput]:
    """POST /v1/files with a body that counts what was read of it."""
    body = encode_multipart(BOUNDARY, {"purpose": purpose,
                                       "file": _named(content, "in.jsonl")})
    stream = CountingInput(body)
    environ = RequestFactory().post("/v1/files", HTTP_AUTHORIZATION=f"Bearer {key}").environ
    environ.update({"wsgi.input": stream, "CONTENT_LENGTH": str(len(body)),
                    "CONTENT_TYPE": f"multipart/form-data; boundary={BOUNDARY}"})
    return WSGIRequest(environ), stream


def post_upload(key: str, content: bytes, purpose: str = "batch") -> tuple[Any, CountingInput]:
    request, stream = upload_request(key, content, purpose)
    return batch_views.files(request), stream


def _named(content: bytes, name: str) -> io.BytesIO:
    named = io.BytesIO(content)
    named.name = name
    return named


def many_lines(count: int, prompt: str = "p" * 200) -> bytes:
    return jsonl(*(line(f"req-{n}", prompt) for n in range(count)))


def test_an_upload_past_the_cap_is_refused_while_it_streams_with_nothing_left_behind(
        fleet: Any, batch_settings: Any, tmp_path: Path) -> None:
    spill = tmp_path / "uploads"
    spill.mkdir()
    batch_settings.FILE_UPLOAD_TEMP_DIR = str(spill)  # where Django would spill an upload
    batch_settings.BATCH_FILE_MAX_BYTES = 256 * 1024
    content = many_lines(800)  # about 290 KiB: past the cap, within its framing allowance
    response, body = post_upload(fleet["acme"], content)
    assert response.status_code == 413, response.content
    error = json.loads(response.content)["error"]
    assert error["code"] == "file_too_large" and error["param"] == "file"
    assert "larger than 262144 bytes" in error["message"]
    assert "BATCH_FILE_MAX_BYTES" in error["message"]
    # Refused as the bytes passed the cap (the declared length was within the cap and its
    # framing allowance), not after the body was in.
    assert 256 * 1024 < body.taken <= 256 * 1024 + 2 * BatchUploadHandler.chunk_size
    assert BatchFile.objects.count() == 0
    assert list(spill.iterdir()) == []


def test_a_body_declaring_more_than_the_cap_is_refused_before_it_is_read(
        fleet: Any, batch_settings: Any) -> None:
    batch_settings.BATCH_FILE_MAX_BYTES = 1024
    response, body = post_upload(fleet["acme"], many_lines(400))
    assert response.status_code == 413
    assert "more than a file of 1024 bytes" in json.loads(response.content)["error"]["message"]
    assert body.taken == 0
    assert BatchFile.objects.count() == 0


def test_an_upload_is_held_in_memory_once(fleet: Any, batch_settings: Any,
                                          tmp_path: Path) -> None:
    spill = tmp_path / "uploads"
    spill.mkdir()
    batch_settings.FILE_UPLOAD_TEMP_DIR = str(spill)
    content = many_lines(16_000)  # about 6 MB, past Django's 2.5 MB spill-to-disk size
    request, body = upload_request(fleet["acme"], content)
    tracemalloc.start()
    try:
        response: Any = batch_views.files(request)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert response.status_code == 200, response.content
    assert body.taken == len(body.getvalue())
    row = BatchFile.objects.get()
    assert (row.bytes, row.line_count) == (len(content), 16_000)
    assert bytes(row.content) == content
    assert list(spill.iterdir()) == []
    # One buffer of the file, and the driver's copy of it while the INSERT is sent (about
    # 2.4 times the file here); reading it whole, decoding and splitting it, and the ORM's
    # hex spelling of it in the statement (as before) came to more than six times.
    assert peak < 2.5 * len(content), (peak, len(content))


def test_a_line_past_the_line_cap_is_refused_naming_it(fleet: Any, batch_settings: Any) -> None:
    batch_settings.BATCH_LINE_MAX_BYTES = 1000
    content = jsonl(line("a", "x"), line("b", "y" * 5000), line("c", "z"))
    response, body = post_upload(fleet["acme"], content)
    assert response.status_code == 400
    error = json.loads(response.content)["error"]
    assert error["code"] == "line_too_long" and error["param"] == "file"
    assert error["message"].startswith("line 2 is longer than 1000 bytes")
    assert BatchFile.objects.count() == 0


def test_a_bad_line_stops_the_upload_where_it_is(fleet: Any, batch_settings: Any) -> None:
    content = jsonl(line("a", "x"), {"custom_id": "a"}) + many_lines(20_000)
    response, body = post_upload(fleet["acme"], content)
    assert response.status_code == 400
    error = json.loads(response.content)["error"]
    assert error["message"].startswith('line 2: custom_id "a" repeats line 1')
    assert body.taken < 3 * 64 * 1024 < len(content)
    assert BatchFile.objects.count() == 0


def test_only_the_file_field_is_taken(fleet: Any) -> None:
    body = encode_multipart(BOUNDARY, {"purpose": "batch",
                                       "file": [_named(jsonl(line("a", "x")), "one.jsonl"),
                                                _named(jsonl(line("b", "x")), "two.jsonl")]})
    response = Client(HTTP_AUTHORIZATION=f"Bearer {fleet['acme']}").post(
        "/v1/files", body, content_type=f"multipart/form-data; boundary={BOUNDARY}")
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "an upload holds one file, in the field 'file'"
    assert BatchFile.objects.count() == 0


def stored(tenant: Any, content: bytes) -> BatchFile:
    """A file as it sits in the database (written past the upload's checks)."""
    return BatchFile.objects.create(tenant=tenant, purpose="batch", filename="in.jsonl",
                                    bytes=len(content), line_count=0, content=content)


def test_a_batch_is_made_from_its_file_a_chunk_at_a_time(
        fleet: Any, tenants: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks smaller than a line, and a few lines per insert: every line spans chunks.
    monkeypatch.setattr(intake, "STORED_CHUNK_BYTES", 97)
    monkeypatch.setattr(intake, "LINES_PER_INSERT", 7)
    content = many_lines(50, prompt="q" * 150)
    source = stored(tenants["acme"], content)
    assert b"".join(intake.stored_chunks(source)) == content
    batch = intake.create_batch(tenants["acme"], intake.BatchRequest(source.id, "/v1/chat/completions"))
    rows = list(BatchLine.objects.filter(batch=batch).order_by("line_number")
                .values_list("line_number", "custom_id"))
    assert rows == [(n + 1, f"req-{n}") for n in range(50)]


def test_a_bad_line_late_in_a_stored_file_leaves_nothing_written(
        fleet: Any, tenants: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake, "STORED_CHUNK_BYTES", 97)
    monkeypatch.setattr(intake, "LINES_PER_INSERT", 7)
    content = many_lines(40) + b'{"custom_id": "late"}\n'
    source = stored(tenants["acme"], content)
    with pytest.raises(BatchError) as refused:
        intake.create_batch(tenants["acme"], intake.BatchRequest(source.id, "/v1/chat/completions"))
    assert refused.value.message.startswith('line 41: method must be "POST"')
    assert Batch.objects.count() == 0 and BatchLine.objects.count() == 0

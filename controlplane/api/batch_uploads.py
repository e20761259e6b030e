"""Batch input files taken as they stream in: a Django upload handler for `POST /v1/files`.

Django's default handlers write a large upload whole to a temporary file before the view can
look at its size, and the view then read it back into memory. `BatchUploadHandler` instead
takes the multipart field `file` piece by piece as the body is read: a body whose declared
length is past the cap is refused before a byte of it is read, the file's bytes are counted
against BATCH_FILE_MAX_BYTES as they come (413 naming the cap the moment it is passed; the
rest is never read), its lines are checked as they complete (batches.jsonl: a bad line is a
400 at once, naming it), and the bytes are kept in one buffer, the only copy, which is what
is stored. Nothing touches the disk, and a refused upload leaves nothing behind.

A slow upload cannot hold a worker thread either: under gunicorn (whose `--timeout` does not
cover the threaded worker's requests) the upload's socket is watched by one thread, and once
the upload has had BATCH_UPLOAD_GRACE_S and averaged less than BATCH_UPLOAD_MIN_BYTES_PER_S
since it began, its reading side is shut, which ends the worker's blocked read at once; the
view then answers 408 naming both (`UploadWatch`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import IO

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.core.files.uploadhandler import FileUploadHandler, SkipFile
from django.http import HttpRequest

from controlplane.batches import intake
from controlplane.batches.errors import BatchError
from controlplane.batches.jsonl import InputReader

# What a multipart body may hold besides the file: its boundaries, part headers and the
# `purpose` field.
FRAMING_BYTES = 64 * 1024
log = logging.getLogger(__name__)


class UploadWatch:
    """One thread for every upload in this process: cuts the reading side of an upload's
    socket once it is late (`BatchUploadHandler.late`)."""

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._watched: set[BatchUploadHandler] = set()
        self._running = False

    def add(self, upload: BatchUploadHandler) -> None:
        with self._lock:
            self._watched.add(upload)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="upload-watch", daemon=True).start()

    def discard(self, upload: BatchUploadHandler) -> None:
        with self._lock:
            self._watched.discard(upload)

    def _run(self) -> None:
        while True:
            time.sleep(self.every_s)
            with self._lock:
                if not self._watched:
                    self._running = False
                    return
                late = [u for u in self._watched if u.is_late(time.monotonic())]
                self._watched.difference_update(late)
            for upload in late:
                upload.cut()


WATCH = UploadWatch()


class CheckedUpload(UploadedFile):
    """The `file` field of an upload: its bytes, held once, and its lines, already checked."""

    def __init__(self, name: str, content: bytearray, line_count: int,
                 content_type: str | None) -> None:
        super().__init__(file=None, name=name, content_type=content_type, size=len(content))
        self.content = content
        self.line_count = line_count

    def close(self) -> None:  # the request closes its files when it ends
        self.content = bytearray()


class BatchUploadHandler(FileUploadHandler):
    chunk_size = 64 * 1024

    def __init__(self, request: HttpRequest | None = None) -> None:
        super().__init__(request)
        self.max_bytes = intake.max_file_bytes()
        self.reader: InputReader | None = None
        self.content = bytearray()
        self.grace_s = float(settings.BATCH_UPLOAD_GRACE_S)
        self.min_rate = int(settings.BATCH_UPLOAD_MIN_BYTES_PER_S)
        self.started = time.monotonic()
        self.received = 0  # the file's bytes so far
        self.late = False
        self._socket: socket.socket | None = None

    def handle_raw_input(self, input_data: IO[bytes], META: dict[str, str],  # noqa: N803
                         content_length: int, boundary: str, encoding: str | None = None
                         ) -> None:
        if content_length > self.max_bytes + FRAMING_BYTES:
            raise BatchError(f"the request body is {content_length} bytes: more than a file of "
                             f"{self.max_bytes} bytes, the most a batch input file may have "
                             f"(BATCH_FILE_MAX_BYTES), and its multipart framing",
                             status=413, param="file", code="file_too_large")
        sock = META.get("gunicorn.socket")
        if isinstance(sock, socket.socket) and self.min_rate > 0:
            self._socket = sock
            WATCH.add(self)

    def is_late(self, now: float) -> bool:
        return now - self.started > self.grace_s + self.received / self.min_rate

    def cut(self) -> None:
        """End the worker's blocked read: the body ends here (the view answers 408)."""
        self.late = True
        log.warning("upload too slow (%d bytes in %.0f s); cutting it", self.received,
                    time.monotonic() - self.started)
        if self._socket is not None:
            try:
                self._socket.shutdown(socket.SHUT_RD)
            except OSError:
                pass  # gone already

    def stop_watching(self) -> None:
        WATCH.discard(self)

    def too_slow(self) -> BatchError:
        return BatchError(f"the upload arrived slower than {self.min_rate} bytes/s after its "
                          f"first {self.grace_s:g} s (BATCH_UPLOAD_MIN_BYTES_PER_S, "
                          f"BATCH_UPLOAD_GRACE_S; {self.received} bytes of the file received)",
                          status=408, param="file", code="request_timeout")

    def new_file(self, field_name: str, file_name: str, content_type: str,
                 content_length: int | None, charset: str | None = None,
                 content_type_extra: dict[str, bytes] | None = None) -> None:
        if field_name != "file":
            raise SkipFile()  # only `file` is a file here; its bytes are read past, not kept
        if self.reader is not None:
            raise BatchError("an upload holds one file, in the field 'file'", param="file")
        super().new_file(field_name, file_name, content_type, content_length, charset,
                         content_type_extra)
        self.reader = intake.input_reader()

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        if start + len(raw_data) > self.max_bytes:
            raise intake.file_too_large()
        assert self.reader is not None
        self.reader.feed(raw_data)
        self.content += raw_data
        self.received += len(raw_data)

    def file_complete(self, file_size: int) -> CheckedUpload | None:
        reader = self.reader
        if reader is None:
            return None
        reader.end()
        return CheckedUpload(self.file_name or "input.jsonl", self.content, reader.lines,
                             self.content_type)

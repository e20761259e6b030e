"""Batch input files read as a stream: bytes in, checked request lines out, in bounded memory.

`InputReader.feed` takes the file in pieces of any size (an upload as it arrives, a stored
file in chunks) and returns the lines each piece completed, every one checked against the
Batch API's rules; `end` checks what is left. It holds at most one partial line, of at most
`max_line_bytes` (BATCH_LINE_MAX_BYTES), and the custom_ids seen so far (at most
BATCH_FILE_MAX_LINES of them), never the file: a line past the cap, or a file past the line
limit, is refused as soon as it is seen, naming the limit.

The rules: UTF-8 JSON objects, one per line; a non-empty `custom_id` of at most 512
characters, unique in the file; `method` POST; one `url` of ENDPOINTS and one `body.model`
for the whole file; `body.stream` not set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from controlplane.batches.errors import BatchError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
CUSTOM_ID_MAX = 512


@dataclass(frozen=True)
class InputLine:
    number: int
    custom_id: str
    url: str
    body: dict[str, Any]


class InputReader:
    """One input file's lines, checked as its bytes arrive."""

    def __init__(self, max_lines: int, max_line_bytes: int) -> None:
        self.max_lines = max_lines
        self.max_line_bytes = max_line_bytes
        self.lines = 0  # complete lines checked so far
        self.size = 0  # bytes fed so far
        self._partial = bytearray()
        self._seen: dict[str, int] = {}
        self._model: tuple[str, int] | None = None
        self._url: tuple[str, int] | None = None

    def feed(self, piece: bytes | bytearray) -> list[InputLine]:
        """The lines this piece completed, checked; a BatchError at the first bad one."""
        self.size += len(piece)
        checked: list[InputLine] = []
        start = 0
        newline = piece.find(b"\n")
        while newline >= 0:
            self._take(newline - start)
            if self._partial:
                self._partial += piece[start:newline]
                checked.append(self._check(self._partial))
                self._partial = bytearray()
            else:
                checked.append(self._check(piece[start:newline]))
            start = newline + 1
            newline = piece.find(b"\n", start)
        self._take(len(piece) - start)
        self._partial += piece[start:]
        return checked

    def end(self) -> list[InputLine]:
        """The last line if it had no newline; a BatchError for a file with no lines."""
        checked = []
        if self._partial.strip():
            checked.append(self._check(self._partial))
            self._partial = bytearray()
        elif self._partial:  # trailing blanks after the last newline are no line
            self._partial = bytearray()
        if not self.lines:
            raise BatchError("the file has no lines", param="file", code="empty_file")
        return checked

    def _take(self, more: int) -> None:
        """Refuse a line that would pass the per-line cap, before holding any more of it."""
        if len(self._partial) + more > self.max_line_bytes:
            raise BatchError(f"line {self.lines + 1} is longer than {self.max_line_bytes} bytes, "
                             "the longest line a batch input file may have",
                             param="file", code="line_too_long")

    def _check(self, raw: bytes | bytearray) -> InputLine:
        number = self.lines + 1
        if number > self.max_lines:
            raise BatchError(f"the file has more than {self.max_lines} lines; at most "
                             f"{self.max_lines} are allowed", param="file", code="too_many_lines")
        self.lines = number

        def bad(what: str, field: str | None = None) -> BatchError:
            return BatchError(f"line {number}: {what}", param=field or "file",
                              code="invalid_line")

        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BatchError(f"line {number}: not UTF-8 (byte {exc.start} of the line)",
                             param="file", code="invalid_file") from None
        if not text.strip():
            raise bad("the line is empty")
        try:
            row = json.loads(text)
        except ValueError as exc:
            raise bad(f"not valid JSON ({exc})") from None
        if not isinstance(row, dict):
            raise bad("a line must be a JSON object")
        custom_id = row.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise bad("custom_id must be a non-empty string", "custom_id")
        if len(custom_id) > CUSTOM_ID_MAX:
            raise bad(f"custom_id is longer than {CUSTOM_ID_MAX} characters", "custom_id")
        if custom_id in self._seen:
            raise bad(f"custom_id {json.dumps(custom_id)} repeats line {self._seen[custom_id]}",
                      "custom_id")
        self._seen[custom_id] = number
        if row.get("method") != "POST":
            raise bad(f"method must be \"POST\", not {json.dumps(row.get('method'))}", "method")
        line_url = row.get("url")
        if line_url not in ENDPOINTS:
            raise bad(f"url must be one of {', '.join(ENDPOINTS)}, not {json.dumps(line_url)}",
                      "url")
        if self._url is None:
            self._url = (line_url, number)
        elif line_url != self._url[0]:
            raise bad(f"url {line_url} differs from line {self._url[1]}'s {self._url[0]}: one "
                      "endpoint per batch", "url")
        body = row.get("body")
        if not isinstance(body, dict):
            raise bad("body must be a JSON object", "body")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("body.model must be a non-empty string", "body.model")
        if self._model is None:
            self._model = (model, number)
        elif model != self._model[0]:
            raise bad(f"model {json.dumps(model)} differs from line {self._model[1]}'s "
                      f"{json.dumps(self._model[0])}: one model per batch", "body.model")
        if body.get("stream"):
            raise bad("body.stream must be false in a batch", "body.stream")
        return InputLine(number, custom_id, line_url, body)

"""What the request path reads cheaply must still read right: the URL split once into path
and query (and the streamed check made on that path), usage found by search rather than by
regular expressions, and access lines written straight to the stream `configure` opened."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from pathlib import Path

from edge.batch_forward import forwarded
from edge.http_listener import HttpServer
from edge.httpserver import HttpConnection, Request
from edge.logs import ACCESS_LOGGER, AccessLog, configure
from edge.usage import USAGE_WINDOW_BYTES, reported_usage


def test_a_request_carries_its_path_query_and_method_and_only_upload_paths_stream() -> None:
    seen: list[tuple[str, str, str, bool]] = []

    def handler(request: Request, conn: HttpConnection) -> None:
        seen.append((request.method, request.path, request.query, request.stream is not None))
        conn.respond(200, b"{}")

    async def scenario() -> None:
        server = HttpServer(handler, streamed=forwarded, max_streamed_body=1024)
        port = await server.listen("127.0.0.1", 0)
        try:
            for head in (b"GET /v1/models HTTP/1.1",
                         b"POST /v1/chat/completions?x=1&y=%C3%A9 HTTP/1.1",
                         b"DELETE /v1/files/file-1?purpose=batch HTTP/1.1",
                         b"POST /v1/filesystem HTTP/1.1", b"PROPFIND /a%FF?q HTTP/1.1"):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head + b"\r\nhost: edge\r\ncontent-length: 2\r\n\r\n{}")
                answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert answer.startswith(b"HTTP/1.1 200"), answer
                writer.close()
        finally:
            await server.close()

    asyncio.run(scenario())
    assert seen == [
        ("GET", "/v1/models", "", False),
        ("POST", "/v1/chat/completions", "x=1&y=%C3%A9", False),
        ("DELETE", "/v1/files/file-1", "purpose=batch", True),
        ("POST", "/v1/filesystem", "", False),  # a prefix of the path, not the Files API
        ("PROPFIND", "/a%FF", "q", False),  # a method outside the common ones still reads
    ]


def test_forwarded_takes_the_files_and_batches_api_and_nothing_else() -> None:
    for path in ("/v1/files", "/v1/files/f-1/content", "/v1/batches", "/v1/batches/b-1/cancel"):
        assert forwarded(path), path
    for path in ("/v1/filesx", "/v1/batch", "/v1/chat/completions", "/", "", "/v1/files_"):
        assert not forwarded(path), path


# The regular expressions the search replaced, kept here as its specification.
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_USAGE = re.compile(rb'"usage"\s*:\s*\{')


def usage_by_regex(tail: bytes) -> tuple[int, int] | None:
    end = len(tail)
    while True:
        at = tail.rfind(b'"usage"', 0, end)
        if at < 0:
            return None
        key = _USAGE.match(tail, at)
        if key is not None:
            break
        end = at
    window = key.end() + USAGE_WINDOW_BYTES
    prompt = _PROMPT.search(tail, key.end(), window)
    completion = _COMPLETION.search(tail, key.end(), window)
    if prompt is None or completion is None:
        return None
    return int(prompt.group(1)), int(completion.group(1))


def test_usage_search_finds_what_the_regular_expressions_found() -> None:
    spaced = b'{"usage" :\n {\t"completion_tokens" : 7 , "prompt_tokens":\r\n12}}'
    assert reported_usage(spaced) == (12, 7)
    assert reported_usage(b'{"usage": {"prompt_tokens": "12", "completion_tokens": 7}}') is None
    assert reported_usage(b'{"usage": {"prompt_tokens": -1, "completion_tokens": 7}}') is None
    # Counts past the usage object's first bytes are not its own.
    far = b'{"usage": {"prompt_tokens": 1,' + b" " * USAGE_WINDOW_BYTES + \
        b'"completion_tokens": 2}}'
    assert reported_usage(far) is None
    pieces = [b'"usage"', b":", b" ", b"\n", b"{", b"}", b'"prompt_tokens"',
              b'"completion_tokens"', b"12", b"7", b",", b"x", b'"', b"null", b"\t",
              b"0" * 600]
    rng = random.Random(7)
    for _ in range(20_000):
        tail = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert reported_usage(tail) == usage_by_regex(tail), tail


def test_access_lines_go_straight_to_the_configured_file(tmp_path: Path) -> None:
    access, root = logging.getLogger(ACCESS_LOGGER), logging.getLogger()
    saved = [(logger, list(logger.handlers), logger.level, logger.propagate)
             for logger in (access, root)]
    path = tmp_path / "access.log"
    try:
        configure("WARNING", str(path))
        log = AccessLog()
        assert log.sink is not None and log.enabled

        async def write() -> None:
            for i in range(70):  # one full batch of 64, then 6 more for the timer
                log.write(json.dumps({"n": i, "path": "/v1/é"}).encode())

        asyncio.run(write())
        log.flush()
        lines = path.read_bytes().split(b"\n")
        assert lines[-1] == b""  # every line ends with a newline
        assert [json.loads(line) for line in lines[:-1]] == [
            {"n": i, "path": "/v1/é"} for i in range(70)]
    finally:
        # "off" leaves no sink behind for edges later tests start in this process.
        configure("WARNING", "off")
        for handler in access.handlers:
            handler.close()
        for logger, handlers, level, propagate in saved:
            for handler in logger.handlers:
                if handler not in handlers:
                    handler.close()
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate
    off = AccessLog()
    assert off.sink is None

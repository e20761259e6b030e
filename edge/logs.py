"""Logging for the edge process: plain lines for events, one JSON line per request.

Access lines go out in batches: `AccessLog` gathers them and writes every line of the last
200 ms (or 64 lines) at once, as bytes to the stream `configure` opened for them, or as one
record of the `meridian.edge.access` logger where nothing configured one (an edge inside a
test). A logging record costs tens of microseconds, more than the rest of a request's
bookkeeping, so one per request would be the edge's largest cost; batches keep the output
one JSON object per line. Batches stay small (tens of kilobytes) on purpose: a batch of hundreds of
lines allocates and frees enough memory at once for the C library to hand it back to the
system, and the next requests' small allocations then fault fresh pages back in.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import IO, BinaryIO

ACCESS_LOGGER = "meridian.edge.access"


# Where `configure` sends access lines: the binary stream under its handler's, written a
# batch at a time as the bytes they are (a logging record would decode each batch and its
# handler encode it again: 3% of the edge's time per request).
_sink: BinaryIO | None = None


class AccessLog:
    def __init__(self, logger: logging.Logger | None = None, interval_s: float = 0.2,
                 max_lines: int = 64, sink: BinaryIO | None = None) -> None:
        self.logger = logger or logging.getLogger(ACCESS_LOGGER)
        self.interval_s = interval_s
        self.max_lines = max_lines
        # Batches go straight to `sink` (by default the one `configure` set up), else to the
        # logger as one record each.
        self.sink = sink if sink is not None or logger is not None else _sink
        self._lines: list[bytes] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    def write(self, line: bytes) -> None:
        lines = self._lines
        lines.append(line)
        if len(lines) >= self.max_lines:
            self.flush()
        elif self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self.interval_s, self.flush)
            except RuntimeError:  # no loop (a test calling directly): write it now
                self.flush()

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._lines:
            lines, self._lines = self._lines, []
            sink = self.sink
            if sink is not None and self.enabled:
                lines.append(b"")  # the batch's last line ends with a newline too
                sink.write(b"\n".join(lines))
                sink.flush()
            else:
                self.logger.info(b"\n".join(lines).decode())


def configure(level: str = "INFO", access_log: str = "-") -> None:
    """Events to stderr; the access log to stdout ("-"), a file, or nowhere ("off")."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    access = logging.getLogger(ACCESS_LOGGER)
    access.propagate = False
    access.handlers.clear()
    global _sink
    _sink = None
    if access_log == "off":
        access.setLevel(logging.WARNING)
        return
    # The file stays open as long as the process. Batches are written to it directly
    # (`_sink`); the handler serves anything else logged to the access logger.
    stream: IO[str] = sys.stdout if access_log == "-" else open(access_log, "a", encoding="utf-8")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    _sink = getattr(stream, "buffer", None)

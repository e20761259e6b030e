"""Socket writes held until the end of the event loop's pass, then sent together.

Every write to a peer on loopback or a fast network wakes that peer, and a peer woken once
per write answers one request per wake-up. A connection therefore queues what it writes and
registers with its `WriteBatch`; once the loop has run every callback that is ready (all the
reads of this pass), the batch sends each connection's queue in one `transport.write`. A
request's bytes still leave within the pass that produced them, so nothing waits on a timer,
and the order of a connection's writes is kept because all of them go through its queue.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Batched(Protocol):
    def flush(self) -> None: ...


class WriteBatch:
    """Connections with queued writes, flushed once per loop pass (one per event loop)."""

    __slots__ = ("_pending", "_scheduled")

    def __init__(self) -> None:
        self._pending: list[Batched] = []
        self._scheduled = False

    def add(self, conn: Batched) -> None:
        """`conn` has just queued its first write of this pass."""
        self._pending.append(conn)
        if not self._scheduled:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no running loop (a caller outside one): send it now
                self.flush()
                return
            self._scheduled = True

    def flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, []
        for conn in pending:
            conn.flush()

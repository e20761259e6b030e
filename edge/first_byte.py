"""A replica that took a request and sends nothing of its answer: a hung engine.

A wedged GPU or a deadlocked engine worker leaves the replica's kernel acknowledging every
packet, so neither the connect timeout nor the dead-peer timeout (`edge.upstream.watch_peer`)
ever fires, and the request would wait for the pool's read timeout (600 s). Once a second
`FirstByteWatch` looks at every request on an upstream connection whose client has had no
byte of the answer yet, and gives up on its replica when:

- it is a stream and the table policy's `first_byte_timeout_s` (30 s by default: well above
  a loaded engine's time to first token) has passed since it was sent; a stream's first byte
  is its first event, so this is a time-to-first-token limit.
  A non-streamed answer's first byte comes only with the whole answer, which may rightly
  take minutes, so it has no such limit;
- any request, streamed or not, whose replica has been found failing since it was sent:
  ejected (by other requests' failures, this limit's included), down by the edge's /health
  probes, or gone from the table (the control plane failed it), as long as another replica
  may take it. A long answer from a replica that stays healthy is never given up.

Giving up is an upstream failure like a failed connect: the replica's failure is counted
(and ejects it, per `eject_after_failures`) and the request goes to another replica the same
filters allow, never that one (with none left, a 502 naming why). Once bytes reached the
client, the per-token stall timeout and stream resumption take over (`edge.resume`), a
resumed leg's first token included.

The checks cost the request path nothing: no timer per request, one pass over the pool's busy
connections a second, so a request is given up between 0 and 1 s after its limit.
"""

from __future__ import annotations

import asyncio
import logging
import time

from edge.background import stop_task
from edge.exchange import Exchange
from edge.next_replica import another_replica_may_take_it
from edge.upstream import UpstreamError
from edge.upstream_pool import UpstreamPool

log = logging.getLogger("meridian.edge.first_byte")


def overdue(ex: Exchange, now: float) -> str:
    """Why `ex` should give up on its replica now (`now` from `time.perf_counter`), or ""."""
    if ex.finished or ex.client_started or ex.resumption is not None or ex.cset is None \
            or not ex.sent_at:
        return ""
    stats = ex.stats
    if stats is not None and ex.replica is not None and (
            not stats.available(time.monotonic())
            or ex.edge.stats.get(ex.replica.id) is not stats) \
            and another_replica_may_take_it(ex):
        # Ejected, down by its probes, or no longer in the table (the control plane failed
        # it): what was sent there is not coming back.
        return "no answer yet, and the replica has been found failing since the request was sent"
    limit = ex.cset.policy.first_byte_timeout_s
    if ex.stream and now - ex.sent_at >= limit:
        return f"no first token within {limit:g}s of the request (a hung engine?)"
    return ""


def give_up_overdue(pool: UpstreamPool, now: float) -> int:
    """Fail every overdue request over to another replica; how many there were."""
    late: list[tuple[Exchange, str]] = []
    for conn in pool.busy:
        ex = conn.listener
        if isinstance(ex, Exchange) and ex.upstream is conn:
            why = overdue(ex, now)
            if why:
                late.append((ex, why))
    for ex, why in late:
        replica = ex.replica.id if ex.replica is not None else "?"
        log.warning("request %s: replica %s: %s", ex.request_id.decode(), replica, why)
        # Not `reused`: the same replica on a fresh connection would hang the same way.
        ex.on_upstream_error(UpstreamError(why, timeout=True))
    return len(late)


class FirstByteWatch:
    """Runs `give_up_overdue` about once a second while the edge serves."""

    def __init__(self, pool: UpstreamPool, interval_s: float = 1.0) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="first-byte")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                give_up_overdue(self.pool, time.perf_counter())
            except Exception:  # noqa: BLE001 - the watch must outlive one bad pass
                log.exception("first-byte check failed")

"""A completion request's way through the edge: an `Exchange`.

An exchange is a small state machine driven by callbacks from the client connection and
from the upstream connection, with no task of its own unless it has to wait (for a new
upstream connection, or for capacity). Its state is `edge.state.RequestState`.

- `start` runs the checks (`edge.intake.prepare`), `dispatch` schedules (`edge.policy`),
  `send_to` and `begin` send the request to a replica.
- It is sent again to another replica (`send_again`) only while no byte of it reached the
  client (`retry`), or as a stream's next leg (`edge.resume`). Once the answer starts,
  bytes are relayed as they arrive (one client write per upstream read; a stream's events
  whole); any answer but a stream cut mid-way cuts the client's connection, which the
  client sees, rather than being papered over.
- A client that goes away aborts the upstream request: closing that connection is how vLLM
  learns to stop generating.
- Every request ends in `edge.accounting.account`: metrics, the tenant's token correction, and
  one access-log line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from edge import errors, resume
from edge.accounting import account
from edge.answer import response_headers, usage_from_answer, usage_from_tail
from edge.cache_salt import fallback_salt, salted_body
from edge.errors import ClientError
from edge.health import ReplicaStats
from edge.httpserver import HttpConnection, Request
from edge.intake import prepare
from edge.next_replica import (
    another_replica_may_take_it,
    count_failed_attempt,
    may_retry,
    widen,
)
from edge.policy import pick_common, schedule_set
from edge.state import RequestState, Resumption
from edge.table import Replica
from edge.upstream import UpstreamConnection, UpstreamError

# The key engines are started with (vLLM's --api-key), from the same secret the providers use.
_ENGINE_KEY = os.environ.get("MERIDIAN_ENGINE_API_KEY", "")
ENGINE_AUTHORIZATION = b"authorization: Bearer %s\r\n" % _ENGINE_KEY.encode() if _ENGINE_KEY else b""

if TYPE_CHECKING:
    from edge.client_api import ClientApi

log = logging.getLogger("meridian.edge.exchange")

_NOTHING_TRIED: frozenset[str] = frozenset()


class Exchange(RequestState):
    """One completion request on its way through the edge."""

    def __init__(self, api: ClientApi, request: Request, client: HttpConnection,
                 upstream_path: bytes) -> None:
        self.api = api
        self.edge = api.edge
        self.request = request
        self.client = client
        self.upstream_path = upstream_path
        self.request_id = api.request_id(request)
        self.chat = upstream_path == b"/v1/chat/completions"

    # --- from arrival to a replica ------------------------------------------------------

    def start(self) -> None:
        try:
            prepare(self)
        except ClientError as error:
            self.answer_error(error)
            return
        self.client.on_close = self.cancel
        self.dispatch()

    def dispatch(self) -> None:
        """Schedule and send, wait for capacity, or answer why not."""
        edge = self.edge
        assert self.cset is not None and self.route is not None
        if self.tried is None and self.tier != "batch":
            replica = pick_common(self.cset, self.route.prefix, edge.stats, time.monotonic(),
                                  edge.prefix_index, edge.picker_state)
            if replica is not None:
                self.send_to(replica)
                return
        decision = schedule_set(self.cset, self.route, edge.stats, time.monotonic(),
                                edge.prefix_index, edge.picker_state,
                                self.tried or _NOTHING_TRIED)
        replica, reason = decision.replica, decision.reason
        if replica is not None and self.tier == "batch" and edge.queue.interactive_waiting(
                self.model):
            replica, reason = None, "at_capacity"  # batch yields to waiting interactive work
        if replica is not None:
            self.send_to(replica)
        elif reason == "at_capacity":
            self.wait_for_capacity()
        elif widen(self, 503):
            # Its revision has no replica left to take it (a failing canary, ejected):
            # counted as that revision's failure, answered by another revision's replica.
            self.dispatch()
        elif self.tried:
            self.answer_error(ClientError(
                502, f"The replica serving model {self.model} failed ({self.last_failure}) and no "
                "other replica may take the request.", code="upstream_unavailable",
                type_="server_error"))
        else:
            status, message = errors.NO_PICK.get(reason, errors.NO_PICK["no_replicas"])
            self.answer_error(ClientError(
                status, message.format(model=self.model, tenant=self.tenant.tenant
                                       if self.tenant else ""),
                code=reason, type_="server_error", retry_after_s=1))

    def wait_for_capacity(self) -> None:
        edge = self.edge
        if edge.queue.full:
            edge.metrics.queue_waits.inc((self.tier, "refused"))
            self.answer_error(ClientError(
                429, f"Every replica of model {self.model} is at its in-flight limit and the "
                "wait queue is full.", code="queue_full", type_="requests", retry_after_s=1))
            return
        now = time.monotonic()
        if not self.deadline:
            policy = self.cset.policy if self.cset else None
            timeout = 0.0 if policy is None else (
                policy.batch_queue_timeout_s if self.tier == "batch" else policy.queue_timeout_s)
            self.deadline = now + timeout
        self.task = asyncio.get_running_loop().create_task(self._wait(self.deadline - now))

    async def _wait(self, remaining_s: float) -> None:
        edge = self.edge
        started = time.monotonic()
        woken = await edge.queue.wait(self.model, self.tier, remaining_s)
        self.task = None
        self.queued_s += time.monotonic() - started
        if self.finished:
            return
        edge.metrics.queue_waits.inc((self.tier, "woken" if woken else "timeout"))
        if not woken:
            self.answer_error(errors.unavailable(
                "no_capacity", f"Every replica of model {self.model} stayed at its in-flight "
                "limit; try again shortly."))
            return
        self.guarded(self.dispatch)

    def send_to(self, replica: Replica) -> None:
        edge = self.edge
        route = self.route
        if route is not None and route.prefix:
            edge.prefix_index.record(route.prefix, replica.id)
        self.replica = replica
        revision = replica.revision
        self.revision_labels = None if revision is None else (self.model, revision)
        stats = edge.stats.get(replica.id)
        if stats is None:
            stats = edge.stats[replica.id] = ReplicaStats()
        stats.inflight += 1
        self.stats = stats
        conn = None if self.fresh_connection else edge.pool.take(replica.origin)
        if conn is None:
            self.task = asyncio.get_running_loop().create_task(self._connect(replica))
        else:
            self.begin(conn)

    async def _connect(self, replica: Replica) -> None:
        try:
            conn = await self.edge.pool.connect(replica.origin)
        except UpstreamError as exc:
            self.task = None
            if not self.finished:
                self.guarded(self.on_upstream_error, exc)
            return
        self.task = None
        if self.finished:
            conn.close()
            return
        self.guarded(self.begin, conn)

    def begin(self, conn: UpstreamConnection) -> None:
        self.upstream = conn
        assert self.replica is not None
        replica = self.replica
        origin = replica.origin
        head, body = self.head, self.body
        if replica.cache_isolated:
            head, body = self.salted()
        conn.begin(self, b"".join((b"POST ", origin.base_path, head,
                                   replica.engine_authorization or ENGINE_AUTHORIZATION,
                                   b"host: ", origin.host_header, b"\r\n\r\n", body)))
        self.sent_at = time.perf_counter()

    def salted(self) -> tuple[bytes, bytes]:
        """The request's head and body with its tenant's `cache_salt`, made once per body
        (a resumed leg's new body clears them)."""
        if not self.salted_body:
            tenant = self.tenant
            assert tenant is not None
            salt = tenant.cache_salt or fallback_salt(tenant.tenant)
            self.salted_body = salted_body(self.body, salt, self.client_salt)
            self.salted_head = self.api.upstream_head(self.request, self, len(self.salted_body))
        return self.salted_head, self.salted_body

    # --- the replica answers ------------------------------------------------------------

    def on_upstream_head(self, conn: UpstreamConnection) -> bool:
        try:
            resumption = self.resumption
            if resumption is not None and resumption.cut:
                return resume.leg_head(self, conn)
            status = conn.status
            self.head_at = conn.head_at
            if status >= 500:
                self.replica_failed(f"answered {status}")
                # With nowhere else to go, the engine's own answer beats a 502 of ours. A
                # split model's request goes to another revision first (`widen`).
                if may_retry(self) and another_replica_may_take_it(self, widen_first=True):
                    conn.abort()
                    self.upstream = None
                    self.retry(f"answered {status}", status)
                    return False
            else:
                self.replica_answered()
            self.status = status
            return True
        except Exception:  # noqa: BLE001 - a bug here must still answer the client
            self.crashed()
            return False

    def on_upstream_data(self, data: bytes, end: bool) -> None:
        try:
            resumption = self.resumption
            if self.client_started and not end and (resumption is None or not resumption.cut):
                # The common case of a stream, kept short: relay a chunk as it came.
                if resumption is not None:
                    if resumption.held or not data.endswith(b"\n\n") or b'"error"' in data:
                        resume.first_leg(self, data, False)
                        return
                    resumption.kept.append(data)
                now = time.perf_counter()
                self.observe_itl(now - self.last_byte_at)
                self.last_byte_at = now
                self.events += data.count(b"\n\n")
                self.prev_chunk, self.last_chunk = self.last_chunk, data
                self.client.send(data)
            elif resumption is not None and resumption.cut:
                resume.leg_data(self, data, end)
            else:
                self.relay(data, end)
        except Exception:  # noqa: BLE001 - a bug here must still answer the client
            self.crashed()

    def relay(self, data: bytes, end: bool) -> None:
        """The first body bytes (with the head) or the last; `on_upstream_data` does the rest."""
        client = self.client
        now = time.perf_counter()
        conn = self.upstream
        if not self.client_started:
            assert conn is not None
            if 400 <= self.status < 500 and not conn.content_type.startswith(
                    b"text/event-stream"):
                # The engine refused the request: its words, in the edge's error shape.
                self.error_body += data
                if not end:
                    return
                error = errors.engine_error(self.status, self.error_body)
                if error is not None:
                    self.first_byte_at = self.last_byte_at = now
                    self.answer_error(error)
                    return
                data = self.error_body
            self.client_started = True
            headers = response_headers(self, conn)
            tracked = resume.tracks(self, conn)  # a stream that can be resumed
            if end and not tracked and not conn.content_type.startswith(b"text/event-stream"):
                # A whole answer in one read: one write with its length, and its usage.
                self.first_byte_at = self.last_byte_at = now
                client.respond(self.status, data, headers, None)
                self.overhead_s = (self.sent_at - self.request.received_at) + (
                    time.perf_counter() - self.head_at)
                if self.status == 200:
                    usage_from_answer(self, data)
                self.complete()
                return
            client.start(self.status, headers, b"" if tracked else data,
                         length=None if conn.chunked or tracked else conn.content_length)
            self.overhead_s = (self.sent_at - self.request.received_at) + (
                time.perf_counter() - self.head_at)
            client.set_producer(conn)
            self.first_byte_at = self.last_byte_at = now
            if tracked:
                self.resumption = Resumption(self.chat, self.payload or {})
                resume.arm_stall(self)
                resume.first_leg(self, data, end)
                return
            self.events += data.count(b"\n\n")
            self.last_chunk = data
            if end:
                self.end_relay(b"")
            return
        if self.resumption is not None:
            resume.first_leg(self, data, True)  # a stream's end: was it whole?
            return
        if data:
            self.observe_itl(now - self.last_byte_at)
            self.events += data.count(b"\n\n")
            self.prev_chunk, self.last_chunk = self.last_chunk, data
        self.end_relay(data)

    def observe_itl(self, gap: float) -> None:
        metrics = self.edge.metrics
        metrics.itl.observe((self.model,), gap)
        labels = self.revision_labels
        if labels is not None:
            metrics.revision_itl.observe(labels, gap)

    def pass_on(self, data: bytes) -> None:
        """Relay whole stream events (`edge.resume`): what the fast path does."""
        now = time.perf_counter()
        if self.events:
            self.observe_itl(now - self.last_byte_at)
        self.last_byte_at = now
        self.events += data.count(b"\n\n")
        self.prev_chunk, self.last_chunk = self.last_chunk, data
        self.client.send(data)

    def end_relay(self, last: bytes) -> None:
        """The whole response has been relayed."""
        self.client.end(last)
        self.last_byte_at = time.perf_counter()
        resumption = self.resumption
        if self.status == 200 and (resumption is None or not resumption.cut):
            usage_from_tail(self, self.prev_chunk + self.last_chunk)
        self.complete()

    def on_upstream_error(self, error: UpstreamError) -> None:
        try:
            self.upstream_failed(error)
        except Exception:  # noqa: BLE001 - a bug here must still answer the client
            self.crashed()

    def upstream_failed(self, error: UpstreamError) -> None:
        self.drop_upstream()
        if self.client_started and self.resumption is not None:
            resume.leg_failed(self, error)  # a stream: resumed, or ended with an error event
            return
        if self.client_started:
            # Bytes already reached the client: the only honest signal left is a cut stream.
            self.replica_failed(f"failed mid-response: {error}")
            self.code = "upstream_cut"
            self.client.abort()
            self.complete()
            return
        if self.resend_if_stale(error):
            return
        self.replica_failed(str(error))
        if may_retry(self):
            widen(self, 0)
            self.retry(str(error), 502)
            return
        self.answer_error(ClientError(502, f"Replica {self.replica.id if self.replica else '?'}"
                                      f" failed: {error}", code="upstream_unavailable",
                                      type_="server_error"))

    def retry(self, reason: str, status: int = 502) -> None:
        """Before any byte reached the client: the same request to another replica."""
        self.retries += 1
        self.edge.metrics.retries.inc((self.model,))
        count_failed_attempt(self, status)
        self.send_again(self.body, reason)

    def send_again(self, body: bytes, reason: str) -> None:
        """Send `body` (the request's own, or a stream's next leg: `edge.resume`) to a
        replica not tried yet, because the last one failed for `reason`."""
        self.release_slot()
        replica = self.replica
        if replica is not None:
            tried = self.tried
            if tried is None:
                tried = self.tried = set()
            tried.add(replica.id)
        self.last_failure = reason
        self.fresh_connection = False
        if body is not self.body:  # a stream's next leg: salted again when sent
            self.body = body
            self.head = self.api.upstream_head(self.request, self, len(body))
            self.salted_body = self.salted_head = b""
        self.dispatch()

    def resend_if_stale(self, error: UpstreamError) -> bool:
        """A pooled connection the replica had already closed is not the replica's fault:
        the same replica again, on a fresh connection. One that timed out (a partition, a
        hung engine) is: a fresh one would too. False when `error` is not that."""
        replica = self.replica
        if not error.reused or error.received_any or error.timeout or self.fresh_connection \
                or replica is None:
            return False
        self.release_slot()
        self.fresh_connection = True
        self.send_to(replica)
        return True

    def replica_answered(self) -> None:
        """The replica answered: a success that ends a run of failures counts."""
        stats = self.stats
        if stats is not None and (stats.consecutive_failures or stats.ejections):
            assert self.replica is not None
            self.edge.record_success(self.replica, stats)

    def drop_upstream(self) -> None:
        """Abort the request on its replica (what tells the engine to stop)."""
        conn = self.upstream
        if conn is not None:
            self.upstream = None
            conn.abort()

    def replica_failed(self, reason: str) -> None:
        if self.replica is None or self.stats is None:
            return
        log.warning("replica %s failed: %s", self.replica.id, reason)
        self.edge.record_failure(self.replica, self.stats)

    # --- endings ------------------------------------------------------------------------

    def cancel(self) -> None:
        """The client went away before its answer was complete."""
        if self.finished:
            return
        if self.task is not None:
            self.task.cancel()
            self.task = None
        self.code = self.code or "client_disconnected"
        self.complete()

    def answer_error(self, error: ClientError) -> None:
        resumption = self.resumption
        if resumption is not None and resumption.cut and self.client.response_started:
            resume.end_with_error(self, "no_replica", "The replica serving this stream failed "
                                  f"({self.last_failure}) and it cannot be resumed: "
                                  f"{error.message}", None)
            return
        self.status, self.code = error.status, error.code
        headers = error.headers() + b"x-request-id: " + self.request_id + b"\r\n"
        self.client.respond(error.status, error.body(), headers)
        self.complete()

    def crashed(self) -> None:
        log.exception("bug while answering request %s", self.request_id.decode())
        self.code = "internal_error"
        if not self.client.response_started:
            self.status = 500
            self.client.respond(500, errors.ClientError(
                500, "internal error", code="internal_error", type_="server_error").body())
        else:
            self.client.abort()
        self.complete()

    def guarded(self, step: Any, *args: Any) -> None:
        """Run a step from a task or callback; a bug in it still ends the request."""
        try:
            step(*args)
        except Exception:  # noqa: BLE001
            self.crashed()

    def release_slot(self) -> None:
        stats = self.stats
        if stats is not None:
            stats.inflight -= 1
            self.stats = None
            queue = self.edge.queue
            if queue.waiting:
                queue.notify(self.model)

    def complete(self) -> None:
        if self.finished:
            return
        self.finished = True
        resumption = self.resumption
        if resumption is not None and resumption.stall_timer is not None:
            resumption.stall_timer.cancel()
            resumption.stall_timer = None
        conn = self.upstream
        if conn is not None:
            self.upstream = None
            if conn.complete:
                self.edge.pool.release(conn)
            else:
                conn.abort()  # unfinished: this is what tells the engine to stop
        self.client.set_producer(None)
        self.release_slot()
        account(self.edge, self)
        self.resumption = None  # the text so far is kept only while its stream is open

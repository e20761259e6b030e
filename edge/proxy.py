"""The client API: authenticate, check, rate-limit, schedule, forward, stream back, account.

`ClientApi.handle` answers `/v1/models`, `/v1/chat/completions`, `/v1/completions` and
`/healthz` on the client listener, and forwards the Files and Batches API to the control
plane (`edge.batch_forward`). A completion is an `Exchange`: a small state machine
driven by callbacks from the client connection and from the upstream connection, with no
task of its own unless it has to wait (for a new upstream connection, or for capacity).

- A request is retried on another replica only while no byte of it has reached the client;
  once the answer starts, bytes are relayed as they arrive (one client write per upstream
  read; a stream's events whole). A stream whose replica fails goes on from another one
  (`edge.resume`), or ends with an error event; any other answer cut mid-way cuts the
  client's connection, which the client sees, rather than being papered over.
- A client that goes away aborts the upstream request: closing that connection is how vLLM
  learns to stop generating.
- Every request ends in `edge.accounting.account`: metrics, the tenant's token correction, and
  one access-log line.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from edge import errors, resume
from edge.accounting import account
from edge.batch_forward import BatchApi, forwarded
from edge.cache_salt import client_salt_problem, fallback_salt, salted_body
from edge.errors import ClientError
from edge.health import ReplicaStats
from edge.httpserver import HttpConnection, Request
from edge.policy import (
    CandidateSet,
    RouteRequest,
    candidate_set,
    in_batch_pool,
    pick_common,
    pick_revision,
    revision_key,
    revision_point,
    schedule_set,
)
from edge.prefix import block_keys, chat_prompt_text, conversation_key
from edge.ratelimit import limit_key
from edge.table import Replica, RoutingTable, TenantRules
from edge.upstream import HOP_BY_HOP, Listener, UpstreamConnection, UpstreamError
from edge.usage import parsed_usage, reported_usage

# The key engines are started with (vLLM's --api-key), from the same secret the providers use.
_ENGINE_KEY = os.environ.get("MERIDIAN_ENGINE_API_KEY", "")
ENGINE_AUTHORIZATION = b"authorization: Bearer %s\r\n" % _ENGINE_KEY.encode() if _ENGINE_KEY else b""

if TYPE_CHECKING:
    from edge.server import Edge

log = logging.getLogger("meridian.edge.proxy")

COMPLETION_PATHS = {"/v1/chat/completions": b"/v1/chat/completions",
                    "/v1/completions": b"/v1/completions"}
FORWARDED_HEADERS = (b"accept", b"traceparent", b"tracestate")
# Roughly four bytes of English per token; the engine's usage corrects it afterwards.
BYTES_PER_TOKEN = 4
_NOTHING_TRIED: frozenset[str] = frozenset()
MAX_REMEMBERED_KEYS = 4096
# The candidate-set key of "every revision with a share" (a split model's fallback).
ANY_REVISION = "*"


class Exchange(Listener):
    """One completion request on its way through the edge."""

    # Defaults live on the class: a request sets only what it changes, which keeps creating
    # one cheap.
    tenant: TenantRules | None = None
    requested_model = ""
    model = ""
    stream = False
    tier = "interactive"
    prompt_text = b""
    prompt_tokens_est = 0
    charged_tokens = 0
    cset: CandidateSet | None = None
    route: RouteRequest | None = None
    head = b""
    body = b""
    # The same with the tenant's `cache_salt` (edge.cache_salt), made when a replica that
    # keeps tenants' caches apart is first chosen; whether the client sent one of its own.
    salted_head = b""
    salted_body = b""
    client_salt = False
    replica: Replica | None = None
    # (model, revision) of the replica sending the answer, for a model whose traffic is split
    # between revisions: what the edge's per-revision metrics are labelled with.
    revision_labels: tuple[str, str] | None = None
    stats: ReplicaStats | None = None  # set while this request holds a slot on the replica
    upstream: UpstreamConnection | None = None
    tried: set[str] | None = None
    retries = 0
    # A split model's revision shares, and whether a failure already moved the request to
    # the other revisions' replicas (`widen`).
    shares: tuple[tuple[str, float], ...] | None = None
    widened = False
    last_failure = ""  # why the last replica tried failed, when one did
    fresh_connection = False
    task: asyncio.Task[None] | None = None
    deadline = 0.0
    queued_s = 0.0
    status = 0
    code = ""
    client_started = False
    finished = False
    sent_at = 0.0
    head_at = 0.0
    first_byte_at = 0.0
    last_byte_at = 0.0
    overhead_s = 0.0
    events = 0
    # The last two reads of a streamed answer: where its usage chunk is.
    prev_chunk = b""
    last_chunk = b""
    prompt_tokens = 0
    completion_tokens = 0
    usage_reported = False
    payload: dict[str, Any] | None = None
    error_body = b""  # an engine's 4xx answer, gathered to be re-worded
    # A resumable stream (edge.resume): the first leg's events relayed, a partial one held.
    kept: list[bytes] | None = None
    held = b""
    resumption: resume.Resumption | None = None
    resumes = 0
    resume_outcome = ""
    leg_sent_at = 0.0
    stall_timer: asyncio.TimerHandle | None = None

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
            self.prepare()
        except ClientError as error:
            self.answer_error(error)
            return
        self.client.on_close = self.cancel
        self.dispatch()

    def prepare(self) -> None:
        """Every check that can refuse the request, in the order a client would fix them.

        Written out flat for the common case (a key this table already knows, a model that
        is not an alias, a tenant within its limits), with what depends only on the table,
        the tenant, the model and the tier looked up once per table (`ClientApi.routes`);
        anything else goes through the general helpers, which give the same answers."""
        api = self.api
        edge = self.edge
        table = edge.table
        if table is None:
            raise errors.unavailable("no_table", "This edge has no routing table yet.")
        request = self.request
        headers = request.headers
        tenant = self.tenant = api.authenticate(request, table)
        payload = self.payload = api.parse_completion(request, self)
        route = api.routes.get((id(tenant), self.requested_model,
                                headers.get(b"x-meridian-tier")))
        if route is None or api.routes_table is not table:
            # The rate limit comes before the model is looked up: a flood naming models that
            # do not exist spends the key's budget like any other.
            self.tier = api.tier_of(request, tenant)
            api.admit(tenant, self)
            self.body = api.resolve_model(request, table, tenant, self, payload)
            cset = self.cset = api.candidates(table, tenant, self.model, self.tier)
            prefix_on = bool(len(cset.replicas) > 1 and table.policy.scorers.get("prefix"))
            if self.model == self.requested_model and self.model not in table.aliases:
                api.remember_route(table, tenant, request, cset, prefix_on)
        else:
            cset = self.cset = route[0]
            self.tier = cset.tier
            self.body = request.body
            prefix_on = route[1]
            charged = 0
            if tenant.rpm > 0 or tenant.tpm > 0:
                charged = edge.limiter.take(limit_key(tenant.tenant, self.tier),
                                            tenant.rpm, tenant.tpm,
                                            self.prompt_tokens_est, time.monotonic())
                if charged < 0:
                    api.admit(tenant, self)  # refuses, or admits after all
                    charged = self.charged_tokens
            self.charged_tokens = charged
            self.model = cset.model
        keys: list[int] = []
        if prefix_on and self.prompt_text:
            keys = block_keys(self.prompt_text, seed=cset.prefix_seed)
        if table.revisions:
            shares = table.revisions.get(self.model)
            if shares is not None:
                messages = payload.get("messages") if self.chat else None
                cset = self.cset = api.revision_candidates(
                    table, tenant, self.model, self.tier, shares, keys, self.prompt_text,
                    messages if isinstance(messages, list) else None)
                self.shares = tuple(shares)
                # Counted against its revision even if no replica of it can take it (all
                # ejected: the edge's own 503); `send_to` labels by the replica that answers.
                revision = cset.replicas[0].revision if cset.replicas else None
                if revision is not None:
                    self.revision_labels = (self.model, revision)
        self.route = RouteRequest(self.model, self.tier, keys, self.prompt_tokens_est)
        self.head = api.upstream_head(request, self, len(self.body))

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
        elif self.widen(503):
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

    def set_body(self, body: bytes) -> None:
        """A new body for the next leg (stream resumption), salted again when sent."""
        self.body = body
        self.head = self.api.upstream_head(self.request, self, len(body))
        self.salted_body = self.salted_head = b""

    # --- the replica answers ------------------------------------------------------------

    def on_upstream_head(self, conn: UpstreamConnection) -> bool:
        try:
            if self.resumption is not None:
                return resume.leg_head(self, conn)
            status = conn.status
            self.head_at = conn.head_at
            stats = self.stats
            if status >= 500:
                self.replica_failed(f"answered {status}")
                # With nowhere else to go, the engine's own answer beats a 502 of ours. A
                # split model's request goes to another revision first (`widen`).
                if self.may_retry() and self.another_replica_may_take_it(widen=True):
                    conn.abort()
                    self.upstream = None
                    self.retry(f"answered {status}", status)
                    return False
            elif stats is not None and (stats.consecutive_failures or stats.ejections):
                assert self.replica is not None
                self.edge.record_success(self.replica, stats)
            self.status = status
            return True
        except Exception:  # noqa: BLE001 - a bug here must still answer the client
            self.crashed()
            return False

    def on_upstream_data(self, data: bytes, end: bool) -> None:
        try:
            if self.client_started and not end and self.resumption is None:
                # The common case of a stream, kept short: relay a chunk as it came.
                kept = self.kept
                if kept is not None:
                    if self.held or not data.endswith(b"\n\n") or b'"error"' in data:
                        resume.first_leg(self, data, False)
                        return
                    kept.append(data)
                now = time.perf_counter()
                self.observe_itl(now - self.last_byte_at)
                self.last_byte_at = now
                self.events += data.count(b"\n\n")
                self.prev_chunk, self.last_chunk = self.last_chunk, data
                self.client.send(data)
            elif self.resumption is not None:
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
            headers = self.response_headers(conn)
            tracked = resume.tracks(self, conn)  # a stream that can be resumed
            if end and not tracked and not conn.content_type.startswith(b"text/event-stream"):
                # A whole answer in one read: one write with its length, and its usage.
                self.first_byte_at = self.last_byte_at = now
                client.respond(self.status, data, headers, None)
                self.overhead_s = (self.sent_at - self.request.received_at) + (
                    time.perf_counter() - self.head_at)
                if self.status == 200:
                    self.usage_from_answer(data)
                self.complete()
                return
            client.start(self.status, headers, b"" if tracked else data,
                         length=None if conn.chunked or tracked else conn.content_length)
            self.overhead_s = (self.sent_at - self.request.received_at) + (
                time.perf_counter() - self.head_at)
            client.set_producer(conn)
            self.first_byte_at = self.last_byte_at = now
            if tracked:
                self.kept = []
                resume.arm_stall(self)
                resume.first_leg(self, data, end)
                return
            self.events += data.count(b"\n\n")
            self.last_chunk = data
            if end:
                self.end_relay(b"")
            return
        if self.kept is not None:
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
        if self.status == 200 and self.resumption is None:
            self.usage_from_tail(self.prev_chunk + self.last_chunk)
        self.complete()

    def on_upstream_error(self, error: UpstreamError) -> None:
        try:
            self.upstream_failed(error)
        except Exception:  # noqa: BLE001 - a bug here must still answer the client
            self.crashed()

    def upstream_failed(self, error: UpstreamError) -> None:
        if self.upstream is not None:
            self.upstream.abort()
            self.upstream = None
        if self.client_started and (self.kept is not None or self.resumption is not None):
            resume.leg_failed(self, error)  # a stream: resumed, or ended with an error event
            return
        if self.client_started:
            # Bytes already reached the client: the only honest signal left is a cut stream.
            self.replica_failed(f"failed mid-response: {error}")
            self.code = "upstream_cut"
            self.client.abort()
            self.complete()
            return
        if error.reused and not error.received_any and not error.timeout \
                and not self.fresh_connection:
            # A pooled connection the replica had already closed; not the replica's fault.
            # One that timed out (a partition, a hung engine) is: a fresh one would too.
            self.release_slot()
            self.fresh_connection = True
            assert self.replica is not None
            self.send_to(self.replica)
            return
        self.replica_failed(str(error))
        if self.may_retry():
            self.widen(0)
            self.retry(str(error), 502)
            return
        self.answer_error(ClientError(502, f"Replica {self.replica.id if self.replica else '?'}"
                                      f" failed: {error}", code="upstream_unavailable",
                                      type_="server_error"))

    def may_retry(self) -> bool:
        table = self.edge.table
        limit = self.cset.policy.retry_before_first_byte if self.cset else 0
        return (table is not None and self.retries < limit and not self.client.response_started)

    def another_replica_may_take_it(self, widen: bool = False) -> bool:
        """Whether a retry finds a replica (or one at capacity); with `widen`, among the
        other revisions' replicas first, for a split model (`widen`)."""
        assert self.cset is not None and self.route is not None and self.replica is not None
        narrow = self.cset
        if widen:
            self.widen(0)
        exclude = {self.replica.id, *(self.tried or ())}
        decision = schedule_set(self.cset, self.route, self.edge.stats, time.monotonic(),
                                exclude=exclude)
        if decision.replica is not None or decision.reason == "at_capacity":
            return True
        if self.cset is not narrow:  # no other revision's replica either: as it was
            self.cset, self.widened = narrow, False
            decision = schedule_set(narrow, self.route, self.edge.stats, time.monotonic(),
                                    exclude=exclude)
            return decision.replica is not None or decision.reason == "at_capacity"
        return False

    def widen(self, status: int) -> bool:
        """A split model's request whose revision failed it (a replica's 5xx or connection
        error before any byte, or none of its replicas left to pick): from now on the other
        revisions' replicas take it, the stable one's first (`ClientAPI.other_revision_
        candidates`). With `status`, the failure is counted against the failed revision
        (what a rollout's analysis judges it by) and the request's own count waits for the
        replica that answers. False when the model is not split or was widened already."""
        if self.shares is None or self.widened or self.tenant is None:
            return False
        table = self.edge.table
        if table is None:
            return False
        failed = (self.replica.revision if self.replica is not None
                  else self.revision_labels[1] if self.revision_labels is not None else None)
        if failed is None:
            return False
        cset = self.api.other_revision_candidates(table, self.tenant, self.model, self.tier,
                                                  self.shares, failed)
        if cset is None:
            return False
        self.widened = True
        self.cset = cset
        if status:
            self.count_failed_attempt(status)
        return True

    def count_failed_attempt(self, status: int) -> None:
        """The attempt that failed, counted against its replica's revision; the request is
        counted again by the replica that answers it (`send_to` labels it)."""
        labels = self.revision_labels
        if labels is not None:
            self.edge.metrics.revision_requests.inc((labels[0], labels[1], status))
            self.revision_labels = None

    def retry(self, reason: str, status: int = 502) -> None:
        self.release_slot()
        assert self.replica is not None
        if self.tried is None:
            self.tried = set()
        self.tried.add(self.replica.id)
        self.retries += 1
        self.last_failure = reason
        self.fresh_connection = False
        self.edge.metrics.retries.inc((self.model,))
        self.count_failed_attempt(status)
        self.dispatch()

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
        if self.resumption is not None and self.client.response_started:
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
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None
        self.kept = None
        self.resumption = None  # the text so far is kept only while its stream is open
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

    # --- reading the answer -------------------------------------------------------------

    def response_headers(self, conn: UpstreamConnection) -> bytes:
        # Pieces joined once: concatenating each header line would make two objects a line.
        parts: list[bytes] = []
        for name, value in conn.headers:
            if name not in HOP_BY_HOP and name != b"x-request-id":
                parts.append(name)
                parts.append(b": ")
                parts.append(value)
                parts.append(b"\r\n")
        assert self.replica is not None
        parts.append(b"x-request-id: ")
        parts.append(self.request_id)
        parts.append(b"\r\nx-meridian-replica: ")
        parts.append(self.replica.id.encode())
        parts.append(b"\r\n")
        return b"".join(parts)

    def record_usage(self, usage: tuple[int, int] | None) -> bool:
        """Keep the (prompt, completion) tokens the engine reported, when it did."""
        if usage is None:
            return False
        self.prompt_tokens, self.completion_tokens = usage
        self.usage_reported = True
        return True

    def usage_from_answer(self, answer: bytes) -> None:
        """Usage from a whole JSON answer received in one read."""
        self.record_usage(reported_usage(answer) or parsed_usage(answer))

    def usage_from_tail(self, tail: bytes) -> None:
        """Usage from the end of an answer (`reported_usage`), or for a stream without a
        usage chunk an estimate from its events."""
        if self.record_usage(reported_usage(tail)):
            return
        if self.events:
            # No usage chunk (the client did not ask for one): one event per token, less the
            # role, finish and [DONE] events, is vLLM's streaming shape.
            self.prompt_tokens = self.prompt_tokens_est
            self.completion_tokens = max(0, self.events - (3 if self.chat else 2))


class ClientApi:
    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex().encode()
        # Authorization header → tenant, for the table it was looked up in (hashing the key
        # is a request's single largest check); only keys the table knows are remembered.
        self._tenant_by_auth: dict[bytes, TenantRules] = {}
        self._tenant_table: RoutingTable | None = None
        # (tenant, model, tier header) → (candidate set, prefix scoring on), for models that
        # are not aliases, valid for `routes_table` (whose tenant objects make the ids sound).
        self.routes: dict[tuple[int, str, bytes | None], tuple[CandidateSet, bool]] = {}
        self.routes_table: RoutingTable | None = None
        self.batch_api = BatchApi(edge)

    def handle(self, request: Request, conn: HttpConnection) -> Coroutine[Any, Any, None] | None:
        path = request.path
        upstream_path = COMPLETION_PATHS.get(path)
        if upstream_path is not None:
            if request.method != "POST":
                conn.respond(405, ClientError(405, f"Use POST for {path}.",
                                              code="method_not_allowed").body())
                return None
            Exchange(self, request, conn, upstream_path).start()
        elif path == "/v1/models":
            self.models(request, conn)
        elif path == "/healthz":
            table = self.edge.table
            conn.respond(200 if table else 503, orjson.dumps(
                {"status": "ok" if table else "no_table",
                 "table_version": table.version if table else None}))
        elif forwarded(path):
            forward = self.batch_api.handle(request, conn)
            return forward.run() if forward is not None else None
        else:
            conn.respond(404, ClientError(404, f"Unknown path {path}.", code="not_found").body())
        return None

    # --- shared checks ------------------------------------------------------------------

    def request_id(self, request: Request) -> bytes:
        given = request.headers.get(b"x-request-id")
        if given and len(given) <= 128 and given.isascii() and b"\r" not in given \
                and b"\n" not in given:
            return given
        return b"%s-%x" % (self._id_prefix, next(self._ids))

    def authenticate(self, request: Request, table: RoutingTable) -> TenantRules:
        auth = request.headers.get(b"authorization")
        if not auth:
            raise errors.unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        known = self._tenant_by_auth
        if self._tenant_table is not table:
            known.clear()
            self._tenant_table = table
        tenant = known.get(auth)
        if tenant is not None:
            return self.fresh_enough(table, tenant)
        scheme, _, key = auth.partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key:
            raise errors.unauthorized("Malformed Authorization header: expected "
                                      "`Bearer <key>`.")
        tenant = table.tenants.get(hashlib.sha256(key).hexdigest())
        if tenant is None:
            raise errors.unauthorized("Incorrect API key provided.")
        if len(known) >= MAX_REMEMBERED_KEYS:
            known.clear()
        known[auth] = tenant
        return self.fresh_enough(table, tenant)

    def fresh_enough(self, table: RoutingTable, tenant: TenantRules) -> TenantRules:
        """A stale table under "fail_closed" serves only the tenants marked fail-open."""
        if table.policy.stale_table_mode == "fail_closed" and not tenant.fail_open \
                and time.time() > table.expires_at:
            raise errors.unavailable(
                "table_expired", f"This edge's routing table v{table.version} is older than "
                f"its max_table_age_s ({table.policy.max_table_age_s:g} s) and the policy "
                "fails closed: requests are refused until a fresh table arrives.", 30)
        return tenant

    def models(self, request: Request, conn: HttpConnection) -> None:
        table = self.edge.table
        try:
            if request.method != "GET":
                raise ClientError(405, "Use GET for /v1/models.", code="method_not_allowed")
            if table is None:
                raise errors.unavailable("no_table", "This edge has no routing table yet.")
            tenant = self.authenticate(request, table)
        except ClientError as error:
            conn.respond(error.status, error.body(), error.headers())
            return
        visible = sorted(
            model for model, replicas in table.models.items()
            if tenant.may_use_model(model) and any(tenant.may_use_replica(r) for r in replicas)
        )
        aliases = sorted(
            name for name, alias in table.aliases.items()
            if (alias.default in visible or any(rule.model in visible for rule in alias.rules))
            and tenant.may_use_model(name)
        )
        conn.respond(200, orjson.dumps({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "meridian"}
            for name in visible + aliases
        ]}))

    def parse_completion(self, request: Request, exchange: Exchange) -> dict[str, Any]:
        try:
            payload = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            raise errors.bad_request(f"The request body is not valid JSON: {exc}", None,
                                     "invalid_json") from None
        if not isinstance(payload, dict):
            raise errors.bad_request("The request body must be a JSON object.", None,
                                     "invalid_json")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise errors.bad_request("You must provide a model parameter (a string).", "model",
                                     "missing_required_parameter" if model is None else
                                     "invalid_type")
        stream = payload.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise errors.bad_request("`stream` must be a boolean.", "stream", "invalid_type")
        for name in ("max_tokens", "max_completion_tokens"):
            value = payload.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise errors.bad_request(f"`{name}` must be a positive integer.", name,
                                         "invalid_value")
        if "cache_salt" in payload:
            problem = client_salt_problem(payload["cache_salt"])
            if problem:
                raise errors.bad_request(problem, "cache_salt", "invalid_value")
            exchange.client_salt = True
        # `exchange.model` stays empty until the model is resolved: a request refused before
        # then is counted under a fixed label (edge.accounting), whatever name it sent.
        exchange.requested_model = model
        exchange.stream = bool(stream)
        if exchange.chat:
            messages = payload.get("messages")
            if not isinstance(messages, list) or not messages:
                raise errors.bad_request("`messages` must be a non-empty list of messages.",
                                         "messages", "missing_required_parameter"
                                         if messages is None else "invalid_value")
            chat_text = chat_prompt_text(messages)
            if chat_text is None:
                for i, message in enumerate(messages):
                    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                        raise errors.bad_request(f"`messages[{i}]` must be an object with a "
                                                 "`role`.", f"messages[{i}]", "invalid_value")
            text = chat_text or ""
        else:
            prompt = payload.get("prompt")
            if isinstance(prompt, str):
                text = prompt
            elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                text = "".join(prompt)
            elif isinstance(prompt, list) and prompt and all(
                    isinstance(p, int) and not isinstance(p, bool) for p in prompt):
                exchange.prompt_tokens_est = len(prompt)  # token ids: counted, not hashed
                return payload
            else:
                raise errors.bad_request("`prompt` must be a string, a list of strings or a "
                                         "list of token ids.", "prompt",
                                         "missing_required_parameter" if prompt is None
                                         else "invalid_value")
        exchange.prompt_text = text.encode()
        exchange.prompt_tokens_est = len(exchange.prompt_text) // BYTES_PER_TOKEN + 1
        return payload

    def tier_of(self, request: Request, tenant: TenantRules) -> str:
        """The tenant's tier, or batch when the request asks for it (a caller may lower its
        own priority, never raise it)."""
        wanted = request.headers.get(b"x-meridian-tier")
        if wanted is not None and wanted.lower() == b"batch":
            return "batch"
        return tenant.tier

    def resolve_model(self, request: Request, table: RoutingTable, tenant: TenantRules,
                      exchange: Exchange, payload: dict[str, Any]) -> bytes:
        """Apply aliases (at `exchange.tier`); the body to forward (re-encoded only if the
        model changed)."""
        tier = exchange.tier
        model = exchange.requested_model
        alias = table.aliases.get(model)
        if alias is not None:
            target = alias.resolve(exchange.prompt_tokens_est, tier)
            if not (tenant.may_use_model(model) or tenant.may_use_model(target)) \
                    or target not in table.models:
                raise errors.model_not_found(model)
            exchange.model = target
            payload["model"] = target
            return orjson.dumps(payload)
        if model not in table.models or not tenant.may_use_model(model):
            raise errors.model_not_found(model)
        exchange.model = model
        return request.body

    def admit(self, tenant: TenantRules, exchange: Exchange) -> None:
        if tenant.rpm <= 0 and tenant.tpm <= 0:
            return
        edge = self.edge
        verdict = edge.limiter.admit(limit_key(tenant.tenant, exchange.tier), tenant.rpm,
                                     tenant.tpm,
                                     exchange.prompt_tokens_est, time.monotonic())
        if not verdict.allowed:
            edge.metrics.rate_limited.inc((tenant.tenant, verdict.limit))
            raise ClientError(429, verdict.detail + f" Please try again in "
                              f"{verdict.retry_after_s}s.", code="rate_limit_exceeded",
                              type_=verdict.limit, retry_after_s=verdict.retry_after_s)
        exchange.charged_tokens = verdict.charged_tokens

    def remember_route(self, table: RoutingTable, tenant: TenantRules, request: Request,
                       cset: CandidateSet, prefix_on: bool) -> None:
        routes = self.routes
        if self.routes_table is not table:
            routes.clear()
            self.routes_table = table
        if len(routes) >= MAX_REMEMBERED_KEYS:
            routes.clear()
        routes[(id(tenant), cset.model, request.headers.get(b"x-meridian-tier"))] = (
            cset, prefix_on)

    def candidates(self, table: RoutingTable, tenant: TenantRules, model: str,
                   tier: str, revision: str = "") -> CandidateSet:
        """The table-level part of scheduling, computed once per table, tenant, model, tier
        (and revision, for a model whose traffic is split: `ANY_REVISION` is every revision
        with a share)."""
        edge = self.edge
        if edge.candidate_sets_version != table.version:
            edge.candidate_sets.clear()
            edge.candidate_sets_version = table.version
        # The tenant objects belong to the table, and the cache is cleared with it, so their
        # identity is a sound key (hashing the rules themselves would cost more than the rest).
        key = (model, id(tenant), tier, revision)
        cset = edge.candidate_sets.get(key)
        if cset is None:
            replicas = table.models[model]
            if tier == "batch":
                replicas = in_batch_pool(replicas, table.batch_pools.get(model), tenant, tier)
            if revision == ANY_REVISION:
                shared = {name for name, share in table.revisions.get(model, ()) if share > 0}
                replicas = tuple(r for r in replicas if r.revision in shared)
            elif revision:
                replicas = tuple(r for r in replicas if r.revision == revision)
            cset = edge.candidate_sets[key] = candidate_set(replicas, tenant, tier,
                                                            table.policy, model)
        return cset

    def revision_candidates(self, table: RoutingTable, tenant: TenantRules, model: str,
                            tier: str, shares: Sequence[tuple[str, float]], keys: list[int],
                            prompt: bytes, messages: list[Any] | None) -> CandidateSet:
        """The candidates of the revision this conversation belongs to: chosen by its key
        (`edge.policy.revision_key`), so every turn (and every edge) picks the same one; a
        request with no prompt text draws at random. When that revision has no replica this
        tenant and tier may use, any revision with a share takes it; a revision with share 0
        never does."""
        conversation = conversation_key(messages) if messages else None
        if conversation is not None:
            point = revision_point(conversation)
        elif prompt:
            point = revision_point(revision_key(keys or block_keys(prompt), prompt))
        else:
            point = self.edge.picker_state.rng.random() * 100.0
        cset = self.candidates(table, tenant, model, tier, pick_revision(shares, point))
        if not cset.replicas:
            cset = self.candidates(table, tenant, model, tier, ANY_REVISION)
        return cset

    def other_revision_candidates(self, table: RoutingTable, tenant: TenantRules, model: str,
                                  tier: str, shares: Sequence[tuple[str, float]],
                                  failed: str) -> CandidateSet | None:
        """Where a request goes after its revision `failed` it: the replicas of the other
        revision with the largest share (during a rollout, the stable one; at a canary's
        100%, the stable replicas still serving at share 0); None when no other revision
        has a replica for it."""
        for name, _ in sorted(shares, key=lambda s: (-s[1], s[0])):
            if name != failed:
                cset = self.candidates(table, tenant, model, tier, name)
                if cset.replicas:
                    return cset
        return None

    def upstream_head(self, request: Request, exchange: Exchange, length: int) -> bytes:
        """The request head after `POST <base path>` (the base path and host are per
        replica). The client's key stays here; the replica's own engine key (the table's
        `engine_key`, else the fleet's MERIDIAN_ENGINE_API_KEY) is added per replica."""
        parts = [exchange.upstream_path, b" HTTP/1.1\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nx-request-id: " % length, exchange.request_id, b"\r\n"]
        headers = request.headers
        for name in FORWARDED_HEADERS:
            value = headers.get(name)
            if value is not None:
                parts.append(name + b": " + value + b"\r\n")
        return b"".join(parts)

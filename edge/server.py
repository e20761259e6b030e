"""One edge process: its state (table, replica stats, limits, prefix index, pool) and the
listeners and background loops that act on it.

The table is swapped as a whole: a request reads `edge.table` once and keeps that version to
the end, so a push never changes a request's view half-way. Accepting a table (pushed or
pulled) is one path: verify, note its revoked keys, check it is for this edge and newer (by
version and by `issued_at`: an older table is a replay), persist atomically, swap.

A table issued more than its policy's `max_table_age_s` ago is stale. The edge keeps serving
it; what it means then is the policy's `stale_table_mode`: "last_known_good" serves every
tenant as before (keys revoked in any table seen since stay refused: `edge.revocations`),
"fail_closed" refuses every tenant but those marked `fail_open` (`edge.client_api`). `/healthz`,
`GET /admin/table` and `/metrics` say which.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge import BUILD
from edge.admin import AdminApi
from edge.admission import CapacityQueue
from edge.batch_forward import forwarded
from edge.client_api import ClientApi
from edge.first_byte import FirstByteWatch
from edge.health import Prober, ReplicaStats, record_failure, record_success
from edge.http_listener import HttpServer
from edge.logs import AccessLog
from edge.metrics import EdgeMetrics, Gauge, Labels
from edge.policy import CandidateSet, PickerState
from edge.prefix import PrefixIndex
from edge.pull import TablePuller
from edge.ratelimit import TenantLimiter
from edge.revocations import Revocations
from edge.table import (
    Replica,
    RoutingTable,
    SignatureError,
    TableError,
    load_last_known_good,
    parse_origin,
    parse_table,
    save_last_known_good,
    verified_document,
)
from edge.upstream_pool import UpstreamPool
from edge.upstream_tls import UpstreamTLS

log = logging.getLogger("meridian.edge")


@dataclass
class EdgeConfig:
    name: str
    region: str
    state_dir: Path
    public_keys: list[Ed25519PublicKey]
    control_plane: str | None = None
    control_plane_token: str | None = None
    # The admin API's HMAC secret (edge.admin_auth); None closes the admin API.
    admin_secret: bytes | None = None
    admin_max_body_bytes: int = 64 * 1024 * 1024
    pull_interval_s: float = 15.0
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    probes: bool = True
    max_body_bytes: int = 8 * 1024 * 1024
    # A batch input file (OpenAI's 200 MB) and its multipart framing, streamed through.
    max_upload_bytes: int = 201 * 1024 * 1024
    max_queue: int = 512
    connect_timeout_s: float = 3.0
    upstream_timeout_s: float = 600.0
    # An upstream connection whose replica acknowledges nothing for this long is closed by
    # the kernel (TCP keepalive and user timeout; edge.upstream.watch_peer): a partition.
    dead_peer_timeout_s: float = 5.0
    client_idle_timeout_s: float = 75.0
    client_request_timeout_s: float = 30.0  # to receive a whole request, head and body
    # An upload streamed through (edge.httpserver) gets client_request_timeout_s, then must
    # average this many bytes a second, or it is answered 408 and its connection ends.
    upload_min_bytes_per_s: int = 64 * 1024
    prefix_index_blocks: int = 100_000
    # mTLS to replicas (edge.upstream_tls); None, for tests and a lab without a CA only:
    # http:// replicas are plain. `python -m edge` needs it unless --plain-upstream.
    upstream_tls: UpstreamTLS | None = None


@dataclass
class TableAnswer:
    """What accepting a table came to: the HTTP status and the JSON the admin API answers."""

    status: int
    body: dict[str, Any] = field(default_factory=dict)


def _read_table(body: bytes, public_keys: list[Ed25519PublicKey]
                ) -> tuple[dict[str, Any], RoutingTable | None, TableError | None]:
    """Verify, then parse: a verified table that does not parse still tells its revocations."""
    document = verified_document(body, public_keys)
    try:
        return document, parse_table(document), None
    except TableError as invalid:
        return document, None, invalid


def _refusal(status: int, code: str, message: str, param: str | None = None,
             **extra: Any) -> TableAnswer:
    return TableAnswer(status, {"error": {"message": message, "type": "invalid_request_error",
                                          "param": param, "code": code}, **extra})


class Edge:
    def __init__(self, config: EdgeConfig) -> None:
        self.config = config
        self.name = config.name
        self.region = config.region
        self.table: RoutingTable | None = None
        self.table_source = ""
        self.table_installed_at = 0.0
        self.revocations = Revocations(config.state_dir)
        self.stats: dict[str, ReplicaStats] = {}
        self.metrics = EdgeMetrics()
        self.metrics.registry.add(Gauge(
            "meridian_edge_table_age_seconds", "Seconds since the served table was issued.",
            collect=self._age_sample))
        self.metrics.registry.add(Gauge(
            "meridian_edge_table_stale", "1 while the served table is older than its "
            "max_table_age_s, labelled with what that means here (stale_table_mode).",
            ("mode",), collect=self._stale_sample))
        self.metrics.build.set(("compiled" if BUILD.native else "source",), 1)
        self.limiter = TenantLimiter()
        self.prefix_index = PrefixIndex(config.prefix_index_blocks)
        self.picker_state = PickerState()
        self.candidate_sets: dict[tuple[str, int, str, str], CandidateSet] = {}
        self.candidate_sets_version = -1
        self.queue = CapacityQueue(config.max_queue)
        self.pool = UpstreamPool(config.connect_timeout_s, config.upstream_timeout_s,
                                 dead_peer_s=config.dead_peer_timeout_s,
                                 tls=config.upstream_tls,
                                 tls_failures=self.metrics.upstream_tls_failures)
        if config.control_plane:
            self.pool.exempt = frozenset({parse_origin(config.control_plane).key})
        self.first_byte = FirstByteWatch(self.pool)
        self.access_log = AccessLog()
        self.client_api = ClientApi(self)
        self.admin_api = AdminApi(self)
        self.client_server: HttpServer | None = None
        self.admin_server: HttpServer | None = None
        self.prober = Prober(self._replicas, self.stats.get, self._probe_fetch,
                             config.probe_interval_s, config.probe_timeout_s, self._probe_changed)
        self.puller = (TablePuller(self, config.control_plane, config.control_plane_token,
                                   config.pull_interval_s) if config.control_plane else None)
        self._table_lock = asyncio.Lock()

    # --- tables -------------------------------------------------------------------------

    def load_last_known_good(self) -> RoutingTable | None:
        """Serve from the table on disk, if there is a good one; never fail to start."""
        self.revocations.load()
        try:
            table = load_last_known_good(self.config.state_dir, self.config.public_keys)
        except TableError as exc:
            log.error("the table in %s is unusable (%s); waiting for a new one",
                      self.config.state_dir, exc)
            self.metrics.table_rejections.inc(("disk",))
            return None
        if table is not None:
            self.install(table, "disk")
            log.info("serving last-known-good table v%d from %s", table.version,
                     self.config.state_dir)
        return table

    async def accept_table(self, body: bytes, source: str) -> TableAnswer:
        loop = asyncio.get_running_loop()
        try:
            # Parsing and verifying a large table takes milliseconds: keep it off the loop.
            document, parsed, problem = await loop.run_in_executor(
                None, _read_table, body, self.config.public_keys)
        except SignatureError as bad_signature:
            self.metrics.table_rejections.inc(("bad_signature",))
            return _refusal(400, "bad_signature", str(bad_signature), bad_signature.field)
        except TableError as not_json:
            self.metrics.table_rejections.inc(("invalid",))
            return _refusal(400, "invalid_table", str(not_json), not_json.field)
        if document.get("edge") in (None, "", self.name):
            self.note_revocations(document.get("revoked_keys"))
        if parsed is None:
            invalid = problem or TableError("the table could not be read")
            self.metrics.table_rejections.inc(("invalid",))
            return _refusal(400, "invalid_table", str(invalid), invalid.field)
        table = parsed
        if table.edge and table.edge != self.name:
            self.metrics.table_rejections.inc(("wrong_edge",))
            return _refusal(400, "wrong_edge", f"this table is for edge {table.edge}, not "
                            f"{self.name}", "edge")
        async with self._table_lock:
            current = self.table
            if current is not None and table.version <= current.version:
                self.metrics.table_rejections.inc(("not_newer",))
                return _refusal(409, "version_not_newer", f"version {table.version} is not "
                                f"newer than the served version {current.version}", "version",
                                version=current.version, hash=current.hash)
            if current is not None and table.issued_at_s < current.issued_at_s:
                self.metrics.table_rejections.inc(("issued_before_served",))
                return _refusal(409, "issued_before_served", f"this table was issued at "
                                f"{table.issued_at or 'an unknown time'}, before the served "
                                f"version {current.version} ({current.issued_at}): a replay",
                                "issued_at", version=current.version, hash=current.hash)
            try:
                await loop.run_in_executor(None, save_last_known_good, self.config.state_dir,
                                           table)
            except OSError as failure:
                log.error("cannot persist table v%d: %s", table.version, failure)
                return TableAnswer(500, {"error": {
                    "message": f"could not persist the table: {failure}", "type": "server_error",
                    "param": None, "code": "persist_failed"}})
            self.install(table, source)
        log.info("table v%d accepted from %s (%s)", table.version, source, table.hash[:12])
        return TableAnswer(200, {"version": table.version, "hash": table.hash})

    def note_revocations(self, hashes: Any) -> None:
        """Remember the revoked keys a verified table names; stop serving them at once."""
        if not isinstance(hashes, list):
            return
        if self.revocations.add([h for h in hashes if isinstance(h, str)]):
            table = self.table
            if table is not None:
                self.table = self.revocations.apply(table)

    def _age_sample(self) -> dict[Labels, float]:
        table = self.table
        return {} if table is None else {(): round(time.time() - table.issued_at_s, 3)}

    def _stale_sample(self) -> dict[Labels, float]:
        table = self.table
        if table is None:
            return {}
        stale = time.time() > table.expires_at
        return {(table.policy.stale_table_mode,): 1.0 if stale else 0.0}

    def freshness(self) -> dict[str, Any]:
        """How old the served table is, and what that means here (health and admin API)."""
        table = self.table
        if table is None:
            return {"table_state": "none"}
        age = time.time() - table.issued_at_s
        stale = age > table.policy.max_table_age_s
        return {
            "table_state": "stale" if stale else "fresh",
            "table_age_s": round(age, 1),
            "max_table_age_s": table.policy.max_table_age_s,
            "stale_table_mode": table.policy.stale_table_mode,
            "serving": ("fail_open_tenants_only" if stale and
                        table.policy.stale_table_mode == "fail_closed" else "all_tenants"),
            "revoked_keys": len(self.revocations),
        }

    def install(self, table: RoutingTable, source: str) -> None:
        self.note_revocations(list(table.revoked_keys))
        table = self.revocations.apply(table)
        self.table = table
        self.table_source = source
        self.table_installed_at = time.time()
        replicas = table.replicas
        ids = {r.id for r in replicas}
        for replica_id in ids:
            self.stats.setdefault(replica_id, ReplicaStats())
        for replica_id in [i for i in self.stats if i not in ids]:
            # Requests still in flight to it hold their own reference to the stats object.
            del self.stats[replica_id]
        origins = {r.origin.key for r in replicas}
        self.pool.close_origins(lambda key: key in origins)
        self.pool.revoked = table.revoked_certificates
        self.metrics.table_version.set((), table.version)
        self.queue.notify_all()

    # --- replica health -----------------------------------------------------------------

    def _replicas(self) -> Iterable[Replica]:
        return self.table.replicas if self.table is not None else ()

    async def _probe_fetch(self, replica: Replica, path: str,
                           timeout_s: float) -> tuple[int, bytes]:
        status, _, body = await self.pool.fetch(replica.origin, "GET", path, timeout_s)
        return status, body

    def _probe_changed(self, replica: Replica, up: bool) -> None:
        if up:
            self.queue.notify(replica.model)

    def record_failure(self, replica: Replica, stats: ReplicaStats) -> None:
        table = self.table
        if table is None:
            return
        ejected_for = record_failure(stats, table.policy, time.monotonic())
        if ejected_for is not None:
            self.metrics.ejections.inc((replica.id,))
            log.warning("ejected replica %s (%s) for %.1fs", replica.id, replica.region,
                        ejected_for)

    def record_success(self, replica: Replica, stats: ReplicaStats) -> None:
        record_success(stats)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self, listen: tuple[str, int], admin_listen: tuple[str, int],
                    tls: ssl.SSLContext | None = None) -> tuple[int, int]:
        """Load the last-known-good table, open both listeners, start the loops.

        Returns the bound ports (useful when asked for port 0).
        """
        self.load_last_known_good()
        self.pool.start()
        self.first_byte.start()
        self.client_server = HttpServer(self.client_api.handle, self.config.max_body_bytes,
                                        self.config.client_idle_timeout_s,
                                        self.config.client_request_timeout_s,
                                        streamed=forwarded,
                                        max_streamed_body=self.config.max_upload_bytes,
                                        min_streamed_rate=self.config.upload_min_bytes_per_s)
        self.admin_server = HttpServer(self.admin_api.handle, self.config.admin_max_body_bytes,
                                       admit_head=self.admin_api.admit_head)
        port = await self.client_server.listen(listen[0], listen[1], ssl=tls)
        admin_port = await self.admin_server.listen(admin_listen[0], admin_listen[1])
        if self.config.probes:
            self.prober.start()
        if self.puller is not None:
            self.puller.start()
        log.info("edge %s (%s) serving on %s:%d, admin on %s:%d; request path %s", self.name,
                 self.region, listen[0], port, admin_listen[0], admin_port, BUILD.detail)
        return port, admin_port

    def inflight(self) -> int:
        return sum(s.inflight for s in self.stats.values())

    async def stop(self, drain_s: float = 10.0) -> None:
        """Stop taking connections, let in-flight requests finish (up to `drain_s`), close."""
        if self.client_server is not None:
            await self.client_server.close()
        deadline = time.monotonic() + drain_s
        while self.inflight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.client_server is not None:
            self.client_server.abort_all()
        await self.first_byte.stop()
        await self.prober.stop()
        if self.puller is not None:
            await self.puller.stop()
        if self.admin_server is not None:
            await self.admin_server.close()
            self.admin_server.abort_all()
        await self.pool.close()
        self.access_log.flush()

"""The edge's admin API, on its own listener (loopback unless told otherwise).

Every `/admin/` path needs an HMAC of the request with this edge's admin secret
(`edge.admin_auth`): the header's shape and time are checked once the head is read, before
the body is (401 naming the problem), a body over the admin limit is refused unread (413),
and the HMAC is checked before a byte of JSON is parsed. `/healthz` and `/metrics` answer
without it, for load balancers and Prometheus.

`PUT /admin/table`: a signed table; 200 once it is on disk and served, 400 for a bad or
missing signature or shape (the field named), 409 when its version is not newer than the one
served. `GET /admin/table`: the served version and hash. `GET /admin/replicas`: what the edge
knows about each replica (in-flight, ejection, probe, engine queue and KV usage).
`GET /healthz`, `GET /metrics` (Prometheus text).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import orjson

from edge import admin_auth
from edge.httpserver import HttpConnection, Request

if TYPE_CHECKING:
    from edge.server import Edge

PROMETHEUS_TEXT = b"text/plain; version=0.0.4; charset=utf-8"


def _error(status: int, code: str, message: str) -> tuple[int, bytes]:
    return status, orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                           "param": None, "code": code}})


def _guarded(path: str) -> bool:
    return path.startswith("/admin/")


class AdminApi:
    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.secret = edge.config.admin_secret

    def admit_head(self, method: str, path: str,
                   headers: dict[bytes, bytes]) -> tuple[int, str, str] | None:
        """Before the body is read: refuse an `/admin/` request without a fresh auth header."""
        if not _guarded(path):
            return None
        if self.secret is None:
            return (503, "admin_auth_unconfigured",
                    "This edge has no admin secret configured; its admin API is closed.")
        try:
            admin_auth.check_head(headers)
        except admin_auth.AdminAuthError as refusal:
            self.edge.metrics.admin_refusals.inc((refusal.code,))
            return refusal.status, refusal.code, refusal.message
        return None

    async def handle(self, request: Request, conn: HttpConnection) -> None:
        path, method = request.path, request.method
        if _guarded(path):
            refusal = self.admit_head(method, path, request.headers)
            if refusal is None and self.secret is not None:
                try:
                    admin_auth.verify(self.secret, method, path, request.headers, request.body)
                except admin_auth.AdminAuthError as bad:
                    self.edge.metrics.admin_refusals.inc((bad.code,))
                    refusal = bad.status, bad.code, bad.message
            if refusal is not None:
                conn.respond(*_error(*refusal))
                return
        if path == "/admin/table":
            if method == "PUT":
                answer = await self.edge.accept_table(request.body, "push")
                conn.respond(answer.status, orjson.dumps(answer.body))
            elif method == "GET":
                conn.respond(200, orjson.dumps(self.table_summary()))
            else:
                conn.respond(*_error(405, "method_not_allowed", "Use GET or PUT."))
        elif path == "/admin/replicas" and method == "GET":
            conn.respond(200, orjson.dumps(self.replicas()))
        elif path == "/healthz" and method == "GET":
            table = self.edge.table
            conn.respond(200 if table else 503, orjson.dumps({
                "status": "ok" if table else "no_table", "edge": self.edge.name,
                "region": self.edge.region, "table_version": table.version if table else None,
                **self.edge.freshness(),
            }))
        elif path == "/metrics" and method == "GET":
            conn.respond(200, self.edge.metrics.registry.render(), content_type=PROMETHEUS_TEXT)
        else:
            conn.respond(*_error(404, "not_found", f"No admin endpoint {method} {path}."))

    def table_summary(self) -> dict[str, object]:
        edge = self.edge
        table = edge.table
        if table is None:
            return {"edge": edge.name, "version": None, "hash": None}
        return {
            "edge": edge.name,
            "version": table.version,
            "hash": table.hash,
            "issued_at": table.issued_at,
            "key_id": table.key_id,
            "source": edge.table_source,
            **edge.freshness(),
            "installed_at": edge.table_installed_at,
            "models": {model: len(replicas) for model, replicas in table.models.items()},
            "tenants": len(table.tenants),
        }

    def replicas(self) -> dict[str, object]:
        edge = self.edge
        table = edge.table
        now = time.monotonic()
        rows = []
        for replica in table.replicas if table else []:
            stats = edge.stats.get(replica.id)
            if stats is None:
                continue
            rows.append({
                "id": replica.id, "model": replica.model, "region": replica.region,
                "jurisdiction": replica.jurisdiction, "state": replica.state,
                "revision": replica.revision,
                "inflight": stats.inflight, "max_inflight": replica.max_inflight,
                "probe_ok": stats.probe_ok, "ejected": stats.ejected(now),
                "ejected_for_s": round(max(0.0, stats.ejected_until - now), 3),
                "consecutive_failures": stats.consecutive_failures,
                "waiting": stats.waiting, "running": stats.running, "kv_usage": stats.kv_usage,
                "metrics_age_s": round(now - stats.metrics_at, 3) if stats.metrics_at else None,
            })
        return {"replicas": rows}

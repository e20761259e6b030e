"""The edge's admin API, on its own listener (keep it off the public network).

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

from edge.httpserver import HttpConnection, Request

if TYPE_CHECKING:
    from edge.server import Edge

PROMETHEUS_TEXT = b"text/plain; version=0.0.4; charset=utf-8"


def _error(status: int, code: str, message: str) -> tuple[int, bytes]:
    return status, orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                           "param": None, "code": code}})


class AdminApi:
    def __init__(self, edge: Edge) -> None:
        self.edge = edge

    async def handle(self, request: Request, conn: HttpConnection) -> None:
        path, method = request.path, request.method
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

"""The client API: `ClientApi.handle` answers the client listener's requests.

`/v1/chat/completions` and `/v1/completions` each become an `edge.exchange.Exchange`;
`/v1/models` lists what the caller's key may use, `/healthz` whether the edge has a table,
and the Files and Batches API goes to the control plane (`edge.batch_forward`). The API
also keeps what a request looks up once per routing table: the tenant of each key, the
route of each (tenant, model, tier header) and the candidate sets (`edge.policy`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from edge import errors
from edge.batch_forward import BatchApi, forwarded
from edge.errors import ClientError
from edge.exchange import Exchange
from edge.httpserver import HttpConnection, Request
from edge.policy import (
    CandidateSet,
    candidate_set,
    in_batch_pool,
    pick_revision,
    revision_key,
    revision_point,
)
from edge.prefix import block_keys, conversation_key
from edge.table import RoutingTable, TenantRules

if TYPE_CHECKING:
    from edge.server import Edge

COMPLETION_PATHS = {"/v1/chat/completions": b"/v1/chat/completions",
                    "/v1/completions": b"/v1/completions"}
FORWARDED_HEADERS = (b"accept", b"traceparent", b"tracestate")
MAX_REMEMBERED_KEYS = 4096
# The candidate-set key of "every revision with a share" (a split model's fallback).
ANY_REVISION = "*"


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

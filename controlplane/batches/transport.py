"""Where a batch's lines go and how one is sent: through an edge at batch tier, or, with no
edge, straight to a ready replica the tenant may use.

Through an edge (`batch_edge_url`: BATCH_EDGE_URL, else the first enabled edge) a line
carries the batch's own key (`runner_key`: the tenant's identity, its jurisdictions) and
`x-meridian-tier: batch`, so the edge serves interactive requests first. Straight to
replicas, the replicas are those the edges' tables would let the tenant use: the residency
rule is the edge's own (`edge.table.TenantRules.may_use_replica`), applied to the replicas
as the tables describe them. A send is one HTTP POST; its answer, or the failure to get one,
is an `Outcome`.
"""

from __future__ import annotations

import json
import random
import secrets
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from django.conf import settings

from controlplane.batches.models import Batch, BatchLine
from controlplane.batches.runner_key import ensure_runner_key
from controlplane.core.models import Tenant, Tier
from controlplane.deployments.models import Deployment, Replica, ReplicaState
from controlplane.routing import cache_salt
from controlplane.routing.models import Edge
from edge.table import Replica as TableReplica
from edge.table import TableError, TenantRules, parse_origin

# How soon a batch looks again at an edge that could not take its lines.
EDGE_RECHECK_S = 1.0
# The edge's error code when no replica of a model serves (edge.errors.NO_PICK).
NO_REPLICA_CODE = "no_replicas"


@dataclass(frozen=True)
class Outcome:
    """What one send produced: an HTTP answer (`status`, `body`) or a transport failure."""

    status: int | None
    body: object  # the answer's JSON (or {"raw": its text}); None without an answer
    request_id: str
    retry_after_s: float | None = None
    error: str = ""

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status == 429 or self.status >= 500

    @property
    def no_replica(self) -> bool:
        """The edge's 503 for a model with no replica serving (a batch pool scaled to zero,
        or one still starting): not an attempt, the line waits for the pool to wake."""
        if self.status != 503 or not isinstance(self.body, dict):
            return False
        error = self.body.get("error")
        return isinstance(error, dict) and error.get("code") == NO_REPLICA_CODE


# -- straight to replicas ---------------------------------------------------------------------


def has_batch_pool(batch: Batch) -> bool:
    """Whether the batch's model has a batch-tier deployment the tenant may use (shared or
    its own): then its lines go to that deployment's replicas alone, as the edges' tables
    say (`batch_pool`), and while it has none they wake it."""
    return Deployment.objects.usable_by(batch.tenant_id).filter(
        served_model_name=batch.model, tier=Tier.BATCH).exists()


def tenant_rules(tenant: Tenant) -> TenantRules:
    """The tenant's residency as an edge's table states it (`routing.services.key_views`):
    its jurisdictions' codes and its regions' `cloud:region` keys."""
    return TenantRules(
        tenant=tenant.name,
        jurisdictions=frozenset(tenant.allowed_jurisdictions.values_list("code", flat=True)),
        regions=frozenset(r.key for r in tenant.allowed_regions.select_related("cloud")))


def table_replica(row: Replica) -> TableReplica:
    """The replica as an edge's table describes it (`routing.compiler.replica_entry`). A
    TableError for a URL no edge could send to."""
    region, owner = row.region, row.deployment.tenant
    return TableReplica(id=str(row.pk), model=row.deployment.served_model_name, url=row.url,
                        origin=parse_origin(row.url), region=region.key,
                        jurisdiction=region.jurisdiction.code, tier=row.deployment.tier,
                        tenant=owner.name if owner is not None else None)


def _may_use(rules: TenantRules, row: Replica) -> bool:
    try:
        return rules.may_use_replica(table_replica(row))
    except TableError:  # not an http(s) URL: nothing could be sent to it
        return False


def eligible_replicas(batch: Batch, pool: bool = False) -> list[Replica]:
    """Ready replicas of the batch's model the tenant may use: shared or its own
    deployments, inside its jurisdictions (and its regions, where it names any); with
    `pool`, those of its batch-tier deployments only."""
    rows = Replica.objects.usable_by(batch.tenant_id).filter(
        state=ReplicaState.READY, deployment__served_model_name=batch.model,
    ).exclude(url="").select_related("deployment__tenant", "region__cloud",
                                     "region__jurisdiction")
    if pool:
        rows = rows.filter(deployment__tier=Tier.BATCH)
    rules = tenant_rules(batch.tenant)
    return [row for row in rows if _may_use(rules, row)]


# -- through an edge --------------------------------------------------------------------------


def batch_edge_url() -> str | None:
    """The edge lines are sent through: BATCH_EDGE_URL, else the first enabled edge with a
    public URL (the lab's first edge); None: no edge, lines go straight to replicas."""
    configured = getattr(settings, "BATCH_EDGE_URL", None)
    if configured:
        return str(configured).rstrip("/")
    edge = Edge.objects.filter(enabled=True).exclude(public_url="").order_by("pk").first()
    return edge.public_url.rstrip("/") if edge is not None else None


@dataclass(frozen=True)
class EdgeRoute:
    """Sending a batch's lines through an edge: where, and the headers that say who at which
    tier."""

    url: str
    headers: dict[str, str]


def edge_route(batch: Batch) -> EdgeRoute | None:
    base = batch_edge_url()
    if base is None:
        return None
    return EdgeRoute(base, {"Authorization": f"Bearer {ensure_runner_key(batch)}",
                            "x-meridian-tier": "batch"})


def edge_unready(route: EdgeRoute, timeout_s: float = 5.0) -> str:
    """Why the edge cannot take the batch's lines now, or "" when it can: it does not answer
    (down, restarting), it has no table yet (503), or it refuses the batch's key (its table
    does not hold it yet: a new key reaches the edges with the next table). Any other answer
    is left to the sends and their retries."""
    request = urllib.request.Request(route.url + "/v1/models", headers=route.headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return ""
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            return "the edge does not know the batch's key yet"
        if exc.code == 503:  # no routing table yet (starting): it would refuse every line
            return f"the edge at {route.url} cannot route yet (503)"
        return ""
    except (TimeoutError, OSError) as exc:  # URLError is an OSError
        return f"the edge at {route.url} does not answer ({exc})"


# -- one send ---------------------------------------------------------------------------------


def send_id(line: BatchLine) -> str:
    """The request id of one send of a line: its batch, line and attempt (what an audit of
    the edges' and engines' logs matches sends by)."""
    return f"req_{line.batch_id.removeprefix('batch_')}_{line.line_number}_{line.attempts}"


def send(url: str, body: Mapping[str, object], timeout_s: float,
         headers: dict[str, str] | None = None, request_id: str = "") -> Outcome:
    """POST one line's body (never streamed) and read the answer."""
    request_id = request_id or "req_" + secrets.token_hex(12)
    request = urllib.request.Request(
        url, data=json.dumps({**body, "stream": False}).encode(), method="POST",
        headers={"Content-Type": "application/json", "x-request-id": request_id,
                 **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return Outcome(response.status, _json(response.read()), request_id)
    except urllib.error.HTTPError as exc:
        retry_after = exc.headers.get("Retry-After") if exc.headers else None
        try:
            wait = float(retry_after) if retry_after else None
        except ValueError:
            wait = None
        return Outcome(exc.code, _json(exc.read()), request_id, retry_after_s=wait)
    except (TimeoutError, OSError) as exc:  # URLError is an OSError
        return Outcome(None, None, request_id, error=f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Targets:
    """Where one round's lines go: the edge, or each to one of `replicas` (spread from a
    random start), with the tenant's prefix-cache salt added for replicas that serve
    several tenants: past the edges, adding it is the runner's job."""

    endpoint: str
    timeout_s: float
    route: EdgeRoute | None
    replicas: list[Replica]
    isolated: frozenset[int] = frozenset()
    salt: str = ""

    def send(self, index: int, line: BatchLine) -> Outcome:
        """Send the round's `index`th line."""
        if self.route is not None:
            return send(self.route.url + self.endpoint, line.body, self.timeout_s,
                        self.route.headers, send_id(line))
        replica = self.replicas[(index + random.randrange(len(self.replicas)))
                                % len(self.replicas)]
        body = cache_salt.salted(line.body, self.salt) if replica.pk in self.isolated \
            else line.body
        return send(replica.url.rstrip("/") + self.endpoint, body, self.timeout_s,
                    request_id=send_id(line))


def targets(batch: Batch, route: EdgeRoute | None, replicas: list[Replica],
            timeout_s: float) -> Targets:
    """This round's targets: through `route` when there is one, else to `replicas`."""
    isolated = frozenset(r.pk for r in replicas if cache_salt.cache_isolated(r))
    salt = cache_salt.tenant_cache_salt(batch.tenant_id) if isolated and route is None else ""
    return Targets(batch.endpoint, timeout_s, route, replicas, isolated, salt)


def _json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return {"raw": raw.decode("utf-8", "replace")[:2000]}

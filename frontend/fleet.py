"""The fleet at a glance: region health, replica counts and $/h, edges and their routes.

Every figure is an aggregate in the database (a fixed number of queries whatever the fleet's
size); `region_health` and `sum_states` are pure and decide what the colours mean.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.db import connection
from django.db.models import Count, OuterRef, Q, Subquery

from controlplane.core.services import Principal
from controlplane.costs.services import BILLED_STATES  # noqa: F401 - the pages use it here
from controlplane.costs.services import billed_usd_h_sql as billed_usd_h
from controlplane.costs.services import replica_usd_h_sql as replica_usd_h  # noqa: F401
from controlplane.deployments.lifecycle import LIVE_STATES
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover.models import Health, RegionHealth
from controlplane.routing.models import Edge, RoutingTable
from regions.models import Region

# Order in which states are listed everywhere: the way a replica moves through them.
STATE_ORDER = (S.PENDING, S.PROVISIONING, S.STARTING, S.READY, S.DEGRADED, S.DRAINING,
               S.FAILED, S.TERMINATED)

HEALTHY, DEGRADED, DOWN, STARTING, IDLE = "healthy", "degraded", "down", "starting", "idle"
HEALTH_ORDER = (HEALTHY, DEGRADED, DOWN, STARTING, IDLE)
HEALTH_MEANING = {
    HEALTHY: "replicas serve; none is degraded or failed",
    DEGRADED: "some replicas are degraded or failed",
    DOWN: "every replica has failed",
    STARTING: "replicas are on their way up; none serves yet",
    IDLE: "nothing serves here: no replicas, or only draining ones",
}
# States a page refreshes quickly for: something is on its way up, out, or down.
IN_FLIGHT_STATES = (S.PENDING, S.PROVISIONING, S.STARTING, S.DRAINING, S.FAILED)
REFRESH_IN_FLIGHT_S = 2  # how often live parts of a page refresh while something is in flight
REFRESH_QUIET_S = 15


def refresh_s(in_flight: bool) -> int:
    return REFRESH_IN_FLIGHT_S if in_flight else REFRESH_QUIET_S


def region_health(counts: Mapping[str, int]) -> str:
    """A region's health from its replicas' states (terminated ones do not count).

    none → idle; all failed → down; any failed or degraded → degraded; some ready →
    healthy; only pending/provisioning/starting → starting; only draining (nothing serves,
    nothing is coming) → idle.
    """
    counts = {state: n for state, n in counts.items() if n > 0 and state != S.TERMINATED}
    total = sum(counts.values())
    if total == 0:
        return IDLE
    if counts.get(S.FAILED, 0) == total:
        return DOWN
    if counts.get(S.FAILED, 0) or counts.get(S.DEGRADED, 0):
        return DEGRADED
    if counts.get(S.READY, 0):
        return HEALTHY
    if counts.get(S.PENDING, 0) or counts.get(S.PROVISIONING, 0) or counts.get(S.STARTING, 0):
        return STARTING
    return IDLE


def visible_replicas(principal: Principal) -> Any:
    return Replica.objects.visible_to(principal)


@dataclass
class RegionStatus:
    key: str
    name: str
    cloud: str
    jurisdiction: str
    latitude: float
    longitude: float
    counts: dict[str, int] = field(default_factory=dict)
    usd_h: Decimal = Decimal(0)
    observed: str = ""  # the failover loop's verdict when it is not healthy: degraded | down

    @property
    def health(self) -> str:
        """The worse of what the replica states say and what the failover loop observed
        (a region whose failed replicas were already replaced elsewhere is still down)."""
        from_states = region_health(self.counts)
        if self.observed == DOWN:
            return DOWN
        if self.observed == DEGRADED and from_states in (HEALTHY, STARTING, IDLE):
            return DEGRADED
        return from_states

    @property
    def live(self) -> int:
        return sum(n for state, n in self.counts.items() if state in LIVE_STATES)

    @property
    def replicas(self) -> int:
        """Every replica not yet terminated, failed ones included (a down region shows)."""
        return sum(self.counts.values())


@dataclass
class EdgeStatus:
    name: str
    region: str
    latitude: float
    longitude: float
    enabled: bool
    latest_version: int | None
    acked_version: int | None
    last_error: str
    routes: list[str] = field(default_factory=list)

    @property
    def in_sync(self) -> bool:
        """The edge acked its newest table (an edge with no table yet has nothing to miss)."""
        return self.latest_version is None or self.acked_version == self.latest_version


@dataclass
class Overview:
    regions: list[RegionStatus]
    edges: list[EdgeStatus]
    states: dict[str, int]
    usd_h: Decimal
    regions_enabled: int

    @property
    def replicas_live(self) -> int:
        return sum(n for state, n in self.states.items() if state in LIVE_STATES)

    @property
    def regions_serving(self) -> int:
        return sum(1 for r in self.regions if r.counts.get(S.READY) or r.counts.get(S.DEGRADED))

    @property
    def regions_used(self) -> int:
        """Regions this fleet uses: those holding any of the viewer's replicas not yet
        terminated (a failed one too, so a down region still counts). What `regions_serving`
        is a share of; the regions merely open to placement are `regions_enabled`."""
        return sum(1 for r in self.regions if r.replicas)

    @property
    def in_flight(self) -> bool:
        """Something is on its way up, out or down: the page refreshes quickly."""
        return (any(self.states.get(s) for s in IN_FLIGHT_STATES)
                or any(r.health in (DOWN, DEGRADED) for r in self.regions))

    @property
    def edges_in_sync(self) -> int:
        return sum(1 for e in self.edges if e.enabled and e.in_sync)

    @property
    def edges_enabled(self) -> int:
        return sum(1 for e in self.edges if e.enabled)

    def health_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(HEALTH_ORDER, 0)
        for region in self.regions:
            counts[region.health] += 1
        return counts


def sum_states(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Replica counts by state, in lifecycle order, from rows of `state` and `n`."""
    totals: dict[str, int] = {}
    for row in rows:
        totals[row["state"]] = totals.get(row["state"], 0) + row["n"]
    return {state: totals[state] for state in STATE_ORDER if totals.get(state)}


def overview(principal: Principal) -> Overview:
    """Regions (enabled, or holding replicas), the viewer's replicas in them, and edges."""
    rows = list(
        visible_replicas(principal).exclude(state=S.TERMINATED)
        .values("region_id", "state").order_by()
        .annotate(n=Count("id"), usd_h=billed_usd_h())
    )
    by_region: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_region.setdefault(row["region_id"], []).append(row)
    observed = dict(RegionHealth.objects.filter(state__in=(Health.DOWN, Health.DEGRADED))
                    .values_list("region_id", "state"))
    regions = []
    enabled = 0
    for region in (Region.objects.filter(Q(enabled=True) | Q(pk__in=list(by_region)))
                   .select_related("cloud", "jurisdiction")):
        enabled += region.enabled
        here = by_region.get(region.pk, [])
        regions.append(RegionStatus(
            key=region.key, name=region.display_name, cloud=region.cloud.display_name,
            jurisdiction=region.jurisdiction.code, latitude=region.latitude,
            longitude=region.longitude, counts=sum_states(here),
            usd_h=sum((row["usd_h"] or Decimal(0) for row in here), Decimal(0)),
            observed=observed.get(region.pk, ""),
        ))
    edges = edge_statuses()
    serving = {r.key for r in regions if r.live}
    for edge in edges:
        # Tenant users see routes only to regions where they can see replicas.
        edge.routes = [key for key in edge.routes if key in serving]
    return Overview(
        regions=regions, edges=edges, states=sum_states(rows),
        usd_h=sum((r.usd_h for r in regions), Decimal(0)), regions_enabled=enabled,
    )


def edges_with_versions() -> Any:
    """Edges with their newest table's version and how many tables are stored for each."""
    newest = RoutingTable.objects.filter(edge=OuterRef("pk")).order_by("-version")
    return Edge.objects.select_related("region__cloud").annotate(
        latest_version=Subquery(newest.values("version")[:1]),
        table_count=Count("tables"),
    ).order_by("name")


def edge_statuses() -> list[EdgeStatus]:
    routes = edge_routes()
    return [
        EdgeStatus(
            name=edge.name, region=edge.region.key, latitude=edge.region.latitude,
            longitude=edge.region.longitude, enabled=edge.enabled,
            latest_version=edge.latest_version, acked_version=edge.last_acked_version,
            last_error=edge.last_error, routes=routes.get(edge.pk, []),
        )
        for edge in edges_with_versions()
    ]


# The regions each edge sends traffic to, read inside Postgres from the edge's newest table:
# replicas with weight 0 (draining) get no new requests, so they are not routes.
_ROUTES_SQL = """
WITH newest AS (
    SELECT DISTINCT ON (edge_id) id, edge_id
    FROM routing_routingtable ORDER BY edge_id, version DESC
)
SELECT newest.edge_id, ARRAY(
    SELECT DISTINCT replica->>'region'
    FROM routing_routingtable t,
         jsonb_each(t.payload->'models') AS model,
         jsonb_array_elements(model.value->'replicas') AS replica
    WHERE t.id = newest.id AND COALESCE((replica->>'weight')::float, 0) > 0
    ORDER BY 1
)
FROM newest
"""


def edge_routes() -> dict[int, list[str]]:
    with connection.cursor() as cursor:
        cursor.execute(_ROUTES_SQL)
        return {edge_id: list(regions or []) for edge_id, regions in cursor.fetchall()}

"""The placement problem: what the solver is given, and the filters that decide which offers
a deployment may use at all.

Residency and latency are filters, not rows of the model: an offer outside a deployment's
jurisdictions or regions (`offer_allowed`), or too far from its users for its TTFT SLO
(`worst_rtt_ms` against `network_budget_ms`), never becomes a variable, so no plan can break
them. The fit of the deployment's engine on an offer's nodes is the third filter
(`capacity.replica_shape`, applied in `candidates.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from controlplane.placement.capacity import (
    DEFAULT_BATCH,
    DEFAULT_PROFILE,
    GpuSpec,
    ModelSpec,
    ThroughputProfile,
)
from regions.geo import great_circle_km, rtt_ms

# The network round trip may take at most this share of a deployment's TTFT SLO; the rest
# is queueing and prefill.
NETWORK_SHARE_OF_TTFT = 0.5
DEFAULT_MOVE_PENALTY_USD_H = 0.5

Pool = tuple[str, str]  # (region, GPU type)


# -- inputs -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class OfferOption:
    id: int
    region: str  # cloud:code
    cloud: str
    jurisdiction: str
    gpu: GpuSpec
    gpus_per_node: int
    on_demand_usd_h: float  # per node
    spot_usd_h: float | None  # per node; None: no spot market
    latitude: float
    longitude: float
    label: str = ""

    @property
    def pool(self) -> Pool:
        return (self.region, self.gpu.name)


@dataclass(frozen=True)
class DeploymentRequest:
    id: int
    name: str
    model: ModelSpec
    context: int  # tokens per sequence (max_model_len)
    tokens_per_s: float  # demand; 0: only min_replicas
    min_replicas: int
    max_replicas: int
    allowed_jurisdictions: frozenset[str]
    allowed_regions: frozenset[str] = frozenset()  # narrows further when not empty
    spread_regions: int = 1
    spread_clouds: int = 1
    max_spot_fraction: float = 0.0
    ttft_slo_ms: float = 1000.0
    user_locations: tuple[tuple[float, float], ...] = ()  # (lat, lon) of its users
    headroom: float = 1.2
    batch: int = DEFAULT_BATCH  # sequences per engine the replica must hold at `context`
    # The engine every replica is launched with (the deployment's settings): offers are
    # sized, priced and counted against quota for exactly this layout.
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # Clouds its engine can run on (empty: any); enginesim runs only on the lab's `local`.
    allowed_clouds: frozenset[str] = frozenset()

    @property
    def required_tokens_per_s(self) -> float:
        return max(self.tokens_per_s, 0.0) * self.headroom

    @property
    def must_run(self) -> bool:
        """False for a deployment allowed to scale to zero: nothing to place or spread."""
        return self.min_replicas > 0 or self.tokens_per_s > 0


@dataclass(frozen=True)
class QuotaLimit:
    region: str
    gpu: str
    limit_gpus: int  # GPUs these deployments may use in total in the pool


@dataclass(frozen=True)
class ExistingReplica:
    deployment_id: int
    offer_id: int
    spot: bool
    count: int
    usd_h: float | None = None  # per replica, for offers no longer listed


@dataclass(frozen=True)
class PlacementProblem:
    deployments: tuple[DeploymentRequest, ...]
    offers: tuple[OfferOption, ...]
    # (region, GPU type) → GPUs left under quota; a pool not named is unlimited. Takes a
    # mapping or QuotaLimit rows.
    quota_gpus: Mapping[Pool, int] | Iterable[QuotaLimit] = field(default_factory=dict)
    existing: tuple[ExistingReplica, ...] = ()
    move_penalty_usd_h: float = DEFAULT_MOVE_PENALTY_USD_H  # per running replica removed
    time_limit_s: float = 30.0
    mip_rel_gap: float = 0.005
    profile: ThroughputProfile = DEFAULT_PROFILE

    def __post_init__(self) -> None:
        quota = self.quota_gpus
        if not isinstance(quota, Mapping):
            quota = {(q.region, q.gpu): int(q.limit_gpus) for q in quota}
        object.__setattr__(self, "quota_gpus", dict(quota))
        object.__setattr__(self, "deployments", tuple(self.deployments))
        object.__setattr__(self, "offers", tuple(self.offers))
        object.__setattr__(self, "existing", tuple(self.existing))

    @property
    def quota(self) -> dict[Pool, int]:
        return self.quota_gpus  # type: ignore[return-value]


# -- offer filters ----------------------------------------------------------------------------

def offer_allowed(d: DeploymentRequest, o: OfferOption) -> bool:
    """Residency: the jurisdiction (and, if narrowed, the region) must be allowed; and the
    deployment's engine must run on the offer's cloud."""
    if o.jurisdiction not in d.allowed_jurisdictions:
        return False
    if d.allowed_clouds and o.cloud not in d.allowed_clouds:
        return False
    return not d.allowed_regions or o.region in d.allowed_regions


def network_budget_ms(d: DeploymentRequest) -> float:
    return d.ttft_slo_ms * NETWORK_SHARE_OF_TTFT


def worst_rtt_ms(d: DeploymentRequest, o: OfferOption) -> float:
    """Round trip from the farthest of the deployment's users (0 when it names none)."""
    return max((rtt_ms(great_circle_km(lat, lon, o.latitude, o.longitude))
                for lat, lon in d.user_locations), default=0.0)

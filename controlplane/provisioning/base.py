"""The Provider protocol (DESIGN §4) and the small dataclasses that cross it.

A provider turns a ReplicaSpec into a running engine somewhere and reports on it. What a
provider can do is data (`capabilities`), so callers never branch on a provider's name.
Nothing here imports Django or any cloud SDK.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

STATES = ("provisioning", "starting", "running", "failed", "terminated", "unknown")
ERROR_KINDS = ("no_capacity", "quota", "credentials", "invalid", "timeout", "unavailable", "other")


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a provider needs to start one replica of a deployment."""

    replica_id: str
    deployment: str
    model: str  # Hugging Face id, what `vllm serve` loads
    served_model_name: str
    cloud: str  # the provider's name for the cloud (SkyPilot's identifier)
    region: str  # the cloud's region code
    accelerator: str = "H100"
    gpus_per_node: int = 1
    nodes: int = 1
    use_spot: bool = False
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    disaggregation: dict[str, Any] | None = None
    kv_offload: dict[str, Any] | None = None
    engine_profile: str = "llama-8b-h100"
    port: int = 8000
    disk_gb: int = 256
    api_key_env: str = "MERIDIAN_ENGINE_API_KEY"
    vllm_version: str = "0.11.0"
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ProviderHandle:
    """How a provider finds its replica again; `data` is stored as JSON in the Replica row."""

    provider: str
    id: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProviderStatus:
    state: str  # one of STATES
    message: str = ""


@dataclass(frozen=True)
class OfferObservation:
    cloud: str
    region: str
    gpu: str
    gpus_per_node: int
    instance_type: str
    on_demand_usd_h: float
    spot_usd_h: float | None
    source: str
    observed_at: datetime | None = None


@dataclass(frozen=True)
class Capabilities:
    spot: bool = False
    multi_node: bool = False
    network_emulation: bool = False
    offers_catalog: bool = False
    # The provider keeps local state it can reconcile after a control-plane restart.
    adopts_after_restart: bool = False


class ProviderError(Exception):
    """A provider refused or failed; `kind` says what the operator can do about it."""

    def __init__(self, kind: str, message: str) -> None:
        if kind not in ERROR_KINDS:
            kind = "other"
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@runtime_checkable
class Provider(Protocol):
    name: str
    capabilities: Capabilities

    def launch(self, spec: ReplicaSpec) -> ProviderHandle:
        """Start the replica and return at once; poll() follows its progress."""
        ...

    def poll(self, handle: ProviderHandle) -> ProviderStatus: ...

    def endpoint(self, handle: ProviderHandle, from_region: str | None = None) -> str | None:
        """The engine's base URL; as seen from `from_region` where the network is emulated."""
        ...

    def terminate(self, handle: ProviderHandle) -> None:
        """Stop and release the replica; a second call is harmless."""
        ...

    def observe_offers(self) -> list[OfferObservation]: ...

    def adopt_or_reap(self, wanted: set[str]) -> tuple[list[str], list[str]]:
        """Re-adopt resources of `wanted` replica ids; release the rest (if adopts_after_restart)."""
        ...

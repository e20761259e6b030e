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
# Kinds worth retrying later without changing anything: the provider or the cloud was briefly
# unreachable or slow. The others need a different offer, more quota or an operator.
TRANSIENT_ERROR_KINDS = frozenset({"timeout", "unavailable"})

DEFAULT_VLLM_VERSION = "0.32.0"  # the version the contract suite holds enginesim to


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a provider needs to start one replica of a deployment."""

    replica_id: str
    deployment: str
    model: str  # Hugging Face id, what `vllm serve` loads
    served_model_name: str
    cloud: str  # the provider's name for the cloud (SkyPilot's identifier; "local" in the lab)
    region: str  # the cloud's region code
    accelerator: str = "H100"  # SkyPilot's accelerator name
    gpus_per_node: int = 1
    nodes: int = 1
    use_spot: bool = False
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    # Prefill/decode disaggregation, vLLM's --kv-transfer-config: {"kv_connector":
    # "NixlConnector", "kv_role": "kv_both", ...}; None for a plain replica.
    disaggregation: dict[str, Any] | None = None
    # KV offload to host memory: {"size_gib": 64, "backend": "native" | "lmcache"}.
    kv_offload: dict[str, Any] | None = None
    engine: str = "vllm"  # "vllm", or "enginesim" (the simulator; the local provider only)
    engine_profile: str = "llama-8b-h100"  # enginesim's timing profile (local lab only)
    port: int = 8000
    disk_gb: int = 256
    # The name of the secret holding the engine's API key, never its value: the provider
    # reads it from its own environment at launch and hands it to the cloud as a secret.
    api_key_env: str = "MERIDIAN_ENGINE_API_KEY"
    vllm_version: str = DEFAULT_VLLM_VERSION
    env: dict[str, str] = field(default_factory=dict)
    # The replica's own engine API key (core/engine_keys.py): the engine reads it from
    # VLLM_API_KEY in its environment, never from its command line. "" falls back to the
    # secret named by api_key_env.
    engine_key: str = ""
    # mTLS (core/certificates.py): the directory holding the replica's server certificate,
    # key and the CA (cert.pem, key.pem, ca.pem); "" runs the engine on plain HTTP (tests).
    tls_dir: str = ""


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
    # Set with state "failed" when the provider knows why (one of ERROR_KINDS), so the caller
    # can feed quota and offer records the same way as for a ProviderError.
    error_kind: str = ""


@dataclass(frozen=True)
class OfferObservation:
    cloud: str
    region: str
    gpu: str  # SkyPilot's accelerator name
    gpus_per_node: int
    instance_type: str
    on_demand_usd_h: float | None
    spot_usd_h: float | None
    source: str
    observed_at: datetime | None = None


@dataclass(frozen=True)
class Capabilities:
    spot: bool = False
    multi_node: bool = False
    network_emulation: bool = False
    offers_catalog: bool = False
    # The provider keeps state it can reconcile after a control-plane restart.
    adopts_after_restart: bool = False
    # How often a launching replica is worth polling: a local process is up in a second, a
    # cloud cluster in minutes, and every SkyPilot poll costs several API-server requests.
    poll_interval_s: float = 1.0
    # The node keeps its own copy of the replica's certificate, so a renewed one must be
    # sent to it (provisioning.certificate_delivery); a local engine reads the original.
    delivers_certificates: bool = False


class ProviderError(Exception):
    """A provider refused or failed; `kind` says what the operator can do about it."""

    def __init__(self, kind: str, message: str) -> None:
        if kind not in ERROR_KINDS:
            kind = "other"
        super().__init__(kind, message)  # both in args, so the error survives pickling
        self.kind = kind
        self.message = message

    @property
    def transient(self) -> bool:
        return self.kind in TRANSIENT_ERROR_KINDS

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
        """Keep resources of `wanted` replica ids; release the rest. Returns (kept, reaped)."""
        ...

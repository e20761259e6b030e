"""The capacity model (DESIGN §5): whether a model fits, on how many GPUs, and how fast. Pure.

Memory. Weights = parameters × bytes per parameter. KV bytes per token = 2 (K and V) ×
layers × KV heads × head dim × bytes per KV element; when the tensor-parallel size exceeds
the KV heads, vLLM replicates each KV head so every rank holds one, and the replica stores
`tp` heads' worth. vLLM takes `gpu_memory_utilization` (0.9) of every GPU and spends it on
weights, a runtime overhead (CUDA context, activation peak, CUDA graphs; about 1.5 GiB per
GPU) and the KV cache, so a replica on g GPUs of M GiB holds `concurrency` sequences of
`context` tokens when

    weights + g × overhead + concurrency × context × KV bytes per token ≤ g × M × 0.9.

Parallelism. vLLM shards attention heads over tensor-parallel (TP) ranks: the attention
heads must divide by tp, and the KV heads must divide by tp or tp by them. TP stays inside a
node; pipeline parallelism (PP) stages split evenly over the nodes. A deployment sets its TP
and PP and every replica is launched with them as one `vllm serve` engine (provisioning
starts no data-parallel engines), so `replica_shape` sizes exactly that engine on an offer's
nodes: `replica_nodes` (`deployments/shape.py`, the rule provisioning launches and costs
bill by) = ⌈tp × pp ÷ GPUs per node⌉ nodes, all paid for, and GPUs beyond tp × pp sit idle.
`parallel_layout` finds the smallest layout that fits, for choosing a deployment's settings.

Speed. Decode is memory-bound: every step reads the active weights once and the KV cache of
every sequence in the batch (on average half the context is filled), so one engine makes

    tokens/s = batch / (bytes read per step / effective bandwidth),
    effective bandwidth = tp × pp × bandwidth × efficiency(gpu)
                          × (1 − tp_loss × log2 tp) × (1 − pp_loss × (pp − 1)),

where efficiency is the share of peak HBM bandwidth decode kernels reach and the losses are
the all-reduce per layer (TP) and pipeline bubbles (PP). `ThroughputProfile` holds these
numbers and takes measured figures that override the formula, so an operator who has
benchmarked a model on a GPU type can put the measurement in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

# The node-count rule is shared with provisioning and costs, siblings of placement, so it
# lives below them all; placement re-exports it with the rest of the capacity model.
from controlplane.deployments.shape import replica_nodes as replica_nodes

GIB = 1024**3
DTYPE_BYTES: Mapping[str, float] = {
    "float32": 4.0, "fp32": 4.0, "bfloat16": 2.0, "bf16": 2.0, "float16": 2.0, "fp16": 2.0,
    "fp8": 1.0, "float8": 1.0, "int8": 1.0, "int4": 0.5, "awq": 0.5, "gptq": 0.5,
}
GPU_MEMORY_UTILIZATION = 0.9
RUNTIME_OVERHEAD_GIB_PER_GPU = 1.5
# Beyond four nodes per replica, cross-node pipelines are slower than buying a bigger GPU.
MAX_PIPELINE_NODES = 4
DEFAULT_BATCH = 32


@dataclass(frozen=True)
class ModelSpec:
    name: str
    parameters_b: float
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    active_parameters_b: float | None = None  # mixture-of-experts: parameters read per token
    kv_dtype: str | None = None  # None: the same as the weights


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float
    bandwidth_gbps: float


@dataclass(frozen=True)
class ReplicaShape:
    """How one replica of a model runs on an offer's nodes."""

    tensor_parallel: int
    pipeline_parallel: int
    nodes: int
    gpus: int  # every GPU of the replica's nodes: what it pays for and counts against quota
    max_concurrency: int  # sequences of the target context its engine holds
    tokens_per_s: float  # decode throughput of its engine

    @property
    def ranks(self) -> int:
        """GPUs the engine runs on (tp × pp); the rest of `gpus` is paid for but idle."""
        return self.tensor_parallel * self.pipeline_parallel


def bytes_per_element(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unknown dtype {dtype!r}; known: {known}") from None


def weight_bytes(model: ModelSpec) -> float:
    return model.parameters_b * 1e9 * bytes_per_element(model.dtype)


def kv_bytes_per_token(model: ModelSpec, tensor_parallel: int = 1) -> float:
    heads = max(model.kv_heads, tensor_parallel)
    return 2 * model.layers * heads * model.head_dim * bytes_per_element(
        model.kv_dtype or model.dtype)


def usable_bytes(gpu: GpuSpec, gpus: int, utilisation: float = GPU_MEMORY_UTILIZATION,
                 overhead_gib_per_gpu: float = RUNTIME_OVERHEAD_GIB_PER_GPU) -> float:
    """Bytes vLLM may give to weights and KV cache on `gpus` GPUs."""
    return gpus * (gpu.memory_gib * utilisation - overhead_gib_per_gpu) * GIB


def max_concurrency(model: ModelSpec, gpu: GpuSpec, gpus: int, context: int, *,
                    tensor_parallel: int | None = None,
                    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
                    overhead_gib_per_gpu: float = RUNTIME_OVERHEAD_GIB_PER_GPU) -> int:
    """Sequences of `context` tokens whose KV fits beside the weights (0: it does not fit).

    `tensor_parallel` defaults to `gpus` (one TP group); it matters only when it exceeds
    the model's KV heads, which vLLM then replicates.
    """
    room = (usable_bytes(gpu, gpus, gpu_memory_utilization, overhead_gib_per_gpu)
            - weight_bytes(model))
    if room <= 0 or context <= 0:
        return 0
    per_sequence = kv_bytes_per_token(model, tensor_parallel or gpus) * context
    return int(room // per_sequence)


def fits(model: ModelSpec, gpu: GpuSpec, gpus: int, concurrency: int, context: int, *,
         tensor_parallel: int | None = None,
         gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
         overhead_gib_per_gpu: float = RUNTIME_OVERHEAD_GIB_PER_GPU) -> bool:
    """Whether weights, overhead and KV for `concurrency` × `context` tokens fit `gpus` GPUs."""
    return max_concurrency(
        model, gpu, gpus, context, tensor_parallel=tensor_parallel,
        gpu_memory_utilization=gpu_memory_utilization,
        overhead_gib_per_gpu=overhead_gib_per_gpu) >= max(concurrency, 1)


def valid_tensor_parallel(model: ModelSpec, tp: int) -> bool:
    """vLLM's rule: attention heads divide by tp; KV heads divide by tp or tp by them."""
    if tp < 1 or model.attention_heads % tp:
        return False
    return model.kv_heads % tp == 0 or tp % model.kv_heads == 0


def tensor_parallel_sizes(model: ModelSpec, max_gpus: int) -> list[int]:
    """Every valid TP size up to `max_gpus`, smallest first."""
    return [tp for tp in range(1, max_gpus + 1) if valid_tensor_parallel(model, tp)]


def smallest_tensor_parallel(model: ModelSpec, gpu: GpuSpec, gpus_per_node: int,
                             concurrency: int, context: int) -> int | None:
    """The fewest GPUs of one node the model fits on at this concurrency, or None."""
    for tp in tensor_parallel_sizes(model, gpus_per_node):
        if fits(model, gpu, tp, concurrency, context, tensor_parallel=tp):
            return tp
    return None


def parallel_layout(model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, concurrency: int,
                    context: int, max_nodes: int = MAX_PIPELINE_NODES) -> tuple[int, int] | None:
    """(tp, pp): the smallest TP on one node, else the node's largest TP over pp nodes."""
    tp = smallest_tensor_parallel(model, gpu, gpus_per_node, concurrency, context)
    if tp is not None:
        return tp, 1
    sizes = tensor_parallel_sizes(model, gpus_per_node)
    if not sizes:
        return None
    tp = sizes[-1]
    for pp in range(2, min(max_nodes, model.layers) + 1):
        if fits(model, gpu, tp * pp, concurrency, context, tensor_parallel=tp):
            return tp, pp
    return None


DEFAULT_BANDWIDTH_EFFICIENCY: Mapping[str, float] = {
    # Share of peak HBM bandwidth that vLLM's decode kernels sustain at moderate batch;
    # the large-HBM parts lose more to kernel launch and scheduling overhead per step.
    "B200": 0.55, "H200": 0.6, "H100": 0.6, "MI300X": 0.5, "A100-80GB": 0.65,
    "A100": 0.65, "L40S": 0.7, "L4": 0.7, "A10G": 0.7, "A10": 0.7,
}


@dataclass(frozen=True, eq=False)
class ThroughputProfile:
    """Tokens/s of one engine of a model on a GPU type: the bandwidth formula, or a measurement.

    `measured` maps (model name, GPU name, tp, pp) to the decode tokens/s one engine
    sustained at the deployment's batch; such entries replace the formula. Compared and
    hashed by identity, so one profile object can key caches.
    """

    bandwidth_efficiency: Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_BANDWIDTH_EFFICIENCY))
    default_efficiency: float = 0.6
    tensor_parallel_loss: float = 0.06  # per doubling of TP
    pipeline_stage_loss: float = 0.08  # per extra pipeline stage
    measured: Mapping[tuple[str, str, int, int], float] = field(default_factory=dict)

    def engine_tokens_per_s(self, model: ModelSpec, gpu: GpuSpec, tp: int, pp: int, batch: int,
                            context: int) -> float:
        if batch <= 0:
            return 0.0
        known = self.measured.get((model.name, gpu.name, tp, pp))
        if known is not None:
            return known
        params = model.active_parameters_b or model.parameters_b
        read_per_step = (params * 1e9 * bytes_per_element(model.dtype)
                         + batch * (context / 2) * kv_bytes_per_token(model, tp))
        efficiency = self.bandwidth_efficiency.get(gpu.name, self.default_efficiency)
        scale = ((1 - self.tensor_parallel_loss * math.log2(tp))
                 * (1 - self.pipeline_stage_loss * (pp - 1)))
        bandwidth = tp * pp * gpu.bandwidth_gbps * 1e9 * efficiency * max(scale, 0.05)
        return batch * bandwidth / read_per_step


DEFAULT_PROFILE = ThroughputProfile()


def replica_shape(model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, context: int,
                  batch: int = DEFAULT_BATCH, profile: ThroughputProfile = DEFAULT_PROFILE, *,
                  tensor_parallel: int, pipeline_parallel: int) -> ReplicaShape | None:
    """How a replica launched with `tensor_parallel` × `pipeline_parallel` runs on nodes of
    `gpus_per_node` GPUs: one engine holding `batch` sequences of `context` tokens. None when
    the layout is not one vLLM can shard the model by, the nodes cannot hold it, or the
    model and that KV do not fit its GPUs."""
    tp, pp = tensor_parallel, pipeline_parallel
    if not valid_tensor_parallel(model, tp) or pp > model.layers:
        return None
    nodes = replica_nodes(tp, pp, gpus_per_node)
    if nodes is None:
        return None
    per_engine = max_concurrency(model, gpu, tp * pp, context, tensor_parallel=tp)
    if per_engine < max(batch, 1):
        return None
    rate = profile.engine_tokens_per_s(model, gpu, tp, pp, batch, context)
    return ReplicaShape(tensor_parallel=tp, pipeline_parallel=pp, nodes=nodes,
                        gpus=nodes * gpus_per_node, max_concurrency=per_engine,
                        tokens_per_s=rate)

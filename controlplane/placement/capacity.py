"""The capacity model (DESIGN §5): does a model fit, how many GPUs, how fast. Pure.

Weights = parameters × bytes per parameter. KV bytes per token = 2 (K and V) × layers ×
KV heads × head dim × bytes per KV element. A replica on g GPUs of M GiB fits when
weights + runtime overhead + KV for concurrency × context ≤ g × M × utilisation (vLLM's
gpu_memory_utilization, 0.9 by default). Decode is memory-bound, so a replica's token rate
is estimated from memory bandwidth: each decode step reads the weights once and the KV of
every sequence in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
GPU_MEMORY_UTILIZATION = 0.9
# CUDA context, activations and the sampler: about this much per GPU in practice.
RUNTIME_OVERHEAD_GIB_PER_GPU = 1.5
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8, 16)
# Share of peak memory bandwidth decode kernels reach, and the loss per extra TP rank
# (all-reduce per layer).
BANDWIDTH_EFFICIENCY = 0.6
TP_SCALING_LOSS = 0.06
MAX_PIPELINE_NODES = 4


@dataclass(frozen=True)
class ModelSpec:
    name: str
    parameters_b: float
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    active_parameters_b: float | None = None


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float
    bandwidth_gbps: float


@dataclass(frozen=True)
class ReplicaShape:
    """How one replica of a model runs on an offer's nodes."""

    tensor_parallel: int
    pipeline_parallel: int  # = nodes
    gpus: int
    max_concurrency: int
    tokens_per_s: float


def weight_bytes(model: ModelSpec) -> float:
    return model.parameters_b * 1e9 * DTYPE_BYTES[model.dtype]


def kv_bytes_per_token(model: ModelSpec, kv_dtype_bytes: float = 2.0) -> float:
    return 2 * model.layers * model.kv_heads * model.head_dim * kv_dtype_bytes


def usable_bytes(gpu: GpuSpec, gpus: int, utilisation: float = GPU_MEMORY_UTILIZATION) -> float:
    return gpus * (gpu.memory_gib * utilisation - RUNTIME_OVERHEAD_GIB_PER_GPU) * GIB


def max_concurrency(model: ModelSpec, gpu: GpuSpec, gpus: int, context: int) -> int:
    """Sequences of `context` tokens whose KV fits beside the weights (0: does not fit)."""
    room = usable_bytes(gpu, gpus) - weight_bytes(model)
    if room <= 0:
        return 0
    return int(room // (kv_bytes_per_token(model) * context))


def fits(model: ModelSpec, gpu: GpuSpec, gpus: int, concurrency: int, context: int) -> bool:
    return max_concurrency(model, gpu, gpus, context) >= concurrency


def valid_tensor_parallel(model: ModelSpec, tp: int) -> bool:
    """vLLM shards attention heads across TP ranks; KV heads shard or replicate evenly."""
    return (tp in TENSOR_PARALLEL_SIZES and model.attention_heads % tp == 0
            and (model.kv_heads % tp == 0 or tp % model.kv_heads == 0))


def smallest_tensor_parallel(model: ModelSpec, gpu: GpuSpec, gpus_per_node: int,
                             concurrency: int, context: int) -> int | None:
    """The fewest GPUs of one node the model fits on at this concurrency, or None."""
    for tp in TENSOR_PARALLEL_SIZES:
        if tp > gpus_per_node:
            break
        if valid_tensor_parallel(model, tp) and fits(model, gpu, tp, concurrency, context):
            return tp
    return None


def decode_tokens_per_s(model: ModelSpec, gpu: GpuSpec, gpus: int, batch: int,
                        context: int) -> float:
    """Memory-bound decode rate of a replica running `batch` sequences of ~`context` tokens."""
    if batch <= 0:
        return 0.0
    params = model.active_parameters_b or model.parameters_b
    read_per_step = params * 1e9 * DTYPE_BYTES[model.dtype] + batch * context * kv_bytes_per_token(model) / 2
    efficiency = BANDWIDTH_EFFICIENCY * (1 - TP_SCALING_LOSS * math.log2(max(gpus, 1)))
    step_s = read_per_step / (gpus * gpu.bandwidth_gbps * 1e9 * efficiency)
    return batch / step_s


def replica_shape(model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, context: int,
                  batch: int = 32) -> ReplicaShape | None:
    """Smallest single-node TP that fits `batch` sequences, else pipeline over nodes."""
    tp = smallest_tensor_parallel(model, gpu, gpus_per_node, batch, context)
    nodes = 1
    if tp is None:
        tp = max((t for t in TENSOR_PARALLEL_SIZES if t <= gpus_per_node
                  and valid_tensor_parallel(model, t)), default=None)
        if tp is None:
            return None
        for nodes in range(2, MAX_PIPELINE_NODES + 1):
            if fits(model, gpu, tp * nodes, batch, context):
                break
        else:
            return None
    gpus = tp * nodes
    concurrency = max_concurrency(model, gpu, gpus, context)
    rate = decode_tokens_per_s(model, gpu, gpus, min(batch, concurrency), context)
    return ReplicaShape(tp, nodes, gpus, concurrency, rate)

"""The capacity model and the geography, against cases worked out by hand."""

from __future__ import annotations

import pytest

from controlplane.placement.capacity import (
    GIB,
    ModelSpec,
    ThroughputProfile,
    fits,
    kv_bytes_per_token,
    max_concurrency,
    parallel_layout,
    replica_nodes,
    replica_shape,
    smallest_tensor_parallel,
    tensor_parallel_sizes,
    valid_tensor_parallel,
    weight_bytes,
)
from regions.geo import great_circle_km, rtt_ms
from tests.placement.conftest import H100, L4, LLAMA_8B, LLAMA_70B, LLAMA_405B


def test_kv_bytes_per_token_of_llama_8b_is_128_kib():
    assert kv_bytes_per_token(LLAMA_8B) == 2 * 32 * 8 * 128 * 2 == 131072


def test_kv_bytes_per_token_of_llama_70b_is_320_kib():
    assert kv_bytes_per_token(LLAMA_70B) == 2 * 80 * 8 * 128 * 2 == 327680


def test_weights_of_llama_70b_are_about_131_gib():
    assert weight_bytes(LLAMA_70B) == 70.55e9 * 2
    assert weight_bytes(LLAMA_70B) / GIB == pytest.approx(131.41, abs=0.01)


def test_fp8_halves_the_weights_and_kv():
    fp8 = ModelSpec("llama-3.1-8b-fp8", 8.03, 32, 32, 8, 128, dtype="fp8")
    assert weight_bytes(fp8) == weight_bytes(LLAMA_8B) / 2
    assert kv_bytes_per_token(fp8) == 65536


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    # 4 KV heads over 8 ranks: vLLM keeps one per rank, so 8 heads' worth is stored.
    model = ModelSpec("gqa-4", 7, 28, 32, 4, 128)
    assert kv_bytes_per_token(model, tensor_parallel=8) == 2 * kv_bytes_per_token(model)


def test_concurrency_of_llama_8b_on_one_h100():
    # 80 × 0.9 − 1.5 = 70.5 GiB usable; less 14.96 GiB of weights = 55.54 GiB of KV;
    # 8,192 tokens × 128 KiB = 1 GiB per sequence: 55 sequences.
    assert max_concurrency(LLAMA_8B, H100, 1, 8192) == 55
    assert fits(LLAMA_8B, H100, 1, 55, 8192)
    assert not fits(LLAMA_8B, H100, 1, 56, 8192)


def test_utilisation_and_overhead_can_be_set():
    # At 0.5 utilisation: 40 − 1.5 = 38.5 GiB; less 14.96 = 23.54 GiB: 23 sequences.
    assert max_concurrency(LLAMA_8B, H100, 1, 8192, gpu_memory_utilization=0.5) == 23
    assert not fits(LLAMA_8B, H100, 1, 1, 8192, gpu_memory_utilization=0.2)


@pytest.mark.parametrize(
    ("model", "gpu", "per_node", "expected", "why"),
    [
        (LLAMA_8B, H100, 8, 1, "8B fits one H100"),
        (LLAMA_70B, H100, 8, 4,
         "two H100s (141 GiB usable) hold 131.4 GiB of weights but KV for only 7 sequences "
         "of 4,096 tokens (1.25 GiB each); four hold 120"),
        (LLAMA_70B, L4, 8, 8, "eight L4s leave 29.4 GiB of KV: 23 sequences"),
        (LLAMA_70B, L4, 4, None, "four L4s (80.4 GiB usable) cannot hold 131 GiB"),
        (LLAMA_405B, H100, 8, None, "405B bf16 is 756 GiB; one 8×H100 node has 564"),
        (LLAMA_8B, L4, 1, 1, "8B fits one L4 at 4,096 tokens"),
    ],
)
def test_smallest_tensor_parallel(model, gpu, per_node, expected, why):  # type: ignore[no-untyped-def]
    assert smallest_tensor_parallel(model, gpu, per_node, 8, 4096) == expected, why


def test_tensor_parallel_follows_vllms_head_rule():
    assert valid_tensor_parallel(LLAMA_8B, 8)
    assert not valid_tensor_parallel(LLAMA_8B, 3)  # 32 heads
    # phi-4: 40 attention heads, 10 KV heads. 4 and 8 divide neither way; 5 does.
    phi = ModelSpec("phi-4", 14.66, 40, 40, 10, 128)
    assert tensor_parallel_sizes(phi, 8) == [1, 2, 5]


def test_405b_pipelines_over_two_h100_nodes():
    # Two nodes: 16 × 70.5 = 1,128 GiB; less 756 GiB of weights leaves room for 94
    # sequences of 8,192 tokens at 504 KiB a token.
    assert parallel_layout(LLAMA_405B, H100, 8, 16, 8192) == (8, 2)
    shape = replica_shape(LLAMA_405B, H100, 8, 8192, batch=16, tensor_parallel=8,
                          pipeline_parallel=2)
    assert shape is not None
    assert (shape.tensor_parallel, shape.pipeline_parallel, shape.nodes, shape.gpus) == (8, 2, 2, 16)
    assert shape.max_concurrency == 94


def test_too_big_for_its_layout_is_not_placed():
    # Four 8×L4 nodes hold 804 GiB: not 405B's 756 GiB of weights and KV for 32 sequences.
    assert replica_shape(LLAMA_405B, L4, 8, 8192, tensor_parallel=8, pipeline_parallel=4) is None
    # 70B on one H100 (70.5 GiB usable) at TP 1 does not fit, whatever else the node has.
    assert replica_shape(LLAMA_70B, H100, 8, 4096, tensor_parallel=1, pipeline_parallel=1) is None


def test_decode_rate_from_memory_bandwidth():
    # One H100, batch 32 at 4,096 tokens: each step reads 16.06 GB of weights and
    # 32 × 2,048 × 128 KiB = 8.59 GB of KV at 3,350 GB/s × 0.6: 32 / 12.26 ms.
    shape = replica_shape(LLAMA_8B, H100, 1, 4096, tensor_parallel=1, pipeline_parallel=1)
    assert shape is not None
    assert shape.tokens_per_s == pytest.approx(32 * 3350e9 * 0.6 / (16.06e9 + 8.589934592e9))
    assert shape.tokens_per_s == pytest.approx(2609.3, abs=0.1)


def test_a_bigger_node_runs_the_same_one_engine_and_pays_for_idle_gpus():
    # Provisioning launches one `vllm serve` per replica, never data-parallel engines: an
    # 8-GPU node serves what one GPU serves, and every GPU of it is paid for.
    one = replica_shape(LLAMA_8B, H100, 1, 4096, tensor_parallel=1, pipeline_parallel=1)
    eight = replica_shape(LLAMA_8B, H100, 8, 4096, tensor_parallel=1, pipeline_parallel=1)
    assert one and eight
    assert (eight.tensor_parallel, eight.ranks, eight.nodes, eight.gpus) == (1, 1, 1, 8)
    assert eight.tokens_per_s == one.tokens_per_s
    assert eight.max_concurrency == one.max_concurrency


def test_the_configured_tensor_parallelism_is_the_one_sized():
    # TP 4 of 70B (the smallest that fits at this concurrency, see above) and TP 8 both fit
    # one 8×H100 node; each is sized as configured, not as the smallest.
    four = replica_shape(LLAMA_70B, H100, 8, 4096, batch=8, tensor_parallel=4,
                         pipeline_parallel=1)
    eight = replica_shape(LLAMA_70B, H100, 8, 4096, batch=8, tensor_parallel=8,
                          pipeline_parallel=1)
    assert four and eight
    assert (four.tensor_parallel, eight.tensor_parallel) == (4, 8)
    assert eight.max_concurrency > four.max_concurrency
    assert eight.tokens_per_s > four.tokens_per_s
    # TP 3 does not divide 64 attention heads: vLLM refuses it, so no shape.
    assert replica_shape(LLAMA_70B, H100, 8, 4096, tensor_parallel=3, pipeline_parallel=1) is None


@pytest.mark.parametrize(
    ("tp", "pp", "per_node", "nodes"),
    [
        (1, 1, 8, 1), (2, 1, 2, 1), (2, 2, 4, 1), (8, 2, 8, 2), (4, 4, 8, 2), (1, 4, 1, 4),
        (2, 1, 1, None),  # a TP group stays inside one node
        (8, 1, 4, None),
        (4, 3, 8, None),  # 12 ranks on two 8-GPU nodes: three stages do not split over two
        (4, 1, 1, None), (3, 1, 2, None), (1, 1, 0, None), (0, 1, 8, None),
    ],
)
def test_nodes_a_layout_is_launched_on(tp, pp, per_node, nodes):  # type: ignore[no-untyped-def]
    assert replica_nodes(tp, pp, per_node) == nodes


def test_tensor_parallel_costs_some_bandwidth():
    two = ThroughputProfile().engine_tokens_per_s(LLAMA_70B, H100, 2, 1, 8, 4096)
    four = ThroughputProfile().engine_tokens_per_s(LLAMA_70B, H100, 4, 1, 8, 4096)
    assert 1.5 * two < four < 2 * two


def test_measured_throughput_overrides_the_formula():
    profile = ThroughputProfile(measured={("llama-3.1-8b", "H100", 1, 1): 3000.0})
    shape = replica_shape(LLAMA_8B, H100, 2, 4096, profile=profile, tensor_parallel=1,
                          pipeline_parallel=1)
    assert shape is not None and shape.tokens_per_s == 3000.0  # one engine, as launched


def test_gpu_efficiency_is_editable():
    slow = ThroughputProfile(bandwidth_efficiency={"H100": 0.3})
    base = replica_shape(LLAMA_8B, H100, 1, 4096, tensor_parallel=1, pipeline_parallel=1)
    halved = replica_shape(LLAMA_8B, H100, 1, 4096, profile=slow, tensor_parallel=1,
                           pipeline_parallel=1)
    assert base and halved and halved.tokens_per_s == pytest.approx(base.tokens_per_s / 2)


def test_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="'int3'"):
        weight_bytes(ModelSpec("odd", 1, 1, 1, 1, 1, dtype="int3"))


def test_london_to_paris_is_344_km():
    assert great_circle_km(51.5074, -0.1278, 48.8566, 2.3522) == pytest.approx(343.6, abs=0.5)


def test_round_trip_over_fibre():
    # 4.9 µs per km each way: 1,000 km is 9.8 ms there and back, plus 0.5 ms fixed.
    assert rtt_ms(1000) == pytest.approx(10.3)
    assert rtt_ms(0) == pytest.approx(0.5)


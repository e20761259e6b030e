"""The capacity model against hand-computed cases."""

from __future__ import annotations

import pytest

from controlplane.placement.capacity import (
    GIB,
    GpuSpec,
    ModelSpec,
    kv_bytes_per_token,
    max_concurrency,
    replica_shape,
    smallest_tensor_parallel,
    valid_tensor_parallel,
    weight_bytes,
)

LLAMA_8B = ModelSpec("llama-3.1-8b", 8.03, 32, 32, 8, 128)
LLAMA_70B = ModelSpec("llama-3.1-70b", 70.55, 80, 64, 8, 128)
LLAMA_405B = ModelSpec("llama-3.1-405b", 405.85, 126, 128, 8, 128)
H100 = GpuSpec("H100", 80, 3350)
L4 = GpuSpec("L4", 24, 300)


def test_kv_bytes_per_token_hand_computed():
    assert kv_bytes_per_token(LLAMA_8B) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert kv_bytes_per_token(LLAMA_70B) == 2 * 80 * 8 * 128 * 2 == 320 * 1024


def test_weights_hand_computed():
    assert weight_bytes(LLAMA_70B) / GIB == pytest.approx(131.4, abs=0.1)
    assert weight_bytes(LLAMA_8B) / GIB == pytest.approx(14.96, abs=0.01)


def test_concurrency_on_one_h100():
    # usable: 80 × 0.9 − 1.5 = 70.5 GiB; minus 14.96 GiB weights = 55.54 GiB of KV;
    # at 8,192 tokens × 128 KiB = 1 GiB per sequence: 55 sequences.
    assert max_concurrency(LLAMA_8B, H100, 1, 8192) == 55


@pytest.mark.parametrize(
    ("model", "gpu", "per_node", "expected", "why"),
    [
        (LLAMA_8B, H100, 8, 1, "8B fits one H100"),
        (LLAMA_70B, H100, 8, 4,
         "two H100s hold the 131 GiB of weights but KV for only 7 sequences of 4,096 tokens"),
        (LLAMA_70B, L4, 8, 8, "eight L4s leave 29 GiB of KV: 23 sequences"),
        (LLAMA_70B, L4, 4, None, "four L4s cannot hold 131 GiB of weights"),
        (LLAMA_405B, H100, 8, None, "405B bf16 does not fit one 8×H100 node"),
        (LLAMA_8B, L4, 1, 1, "8B fits one L4 at short context"),
    ],
)
def test_smallest_tensor_parallel(model, gpu, per_node, expected, why):  # type: ignore[no-untyped-def]
    assert smallest_tensor_parallel(model, gpu, per_node, 8, 4096) == expected, why


def test_405b_pipelines_over_two_h100_nodes():
    shape = replica_shape(LLAMA_405B, H100, 8, 8192, batch=16)
    assert shape is not None
    assert (shape.tensor_parallel, shape.pipeline_parallel, shape.gpus) == (8, 2, 16)


def test_tensor_parallel_must_divide_heads():
    assert valid_tensor_parallel(LLAMA_8B, 8)
    assert not valid_tensor_parallel(LLAMA_8B, 3)
    assert not valid_tensor_parallel(ModelSpec("odd", 7, 28, 28, 4, 128), 8)


def test_throughput_grows_with_bandwidth_and_gpus():
    on_h100 = replica_shape(LLAMA_8B, H100, 1, 4096)
    on_l4 = replica_shape(LLAMA_8B, L4, 1, 4096, batch=4)
    assert on_h100 and on_l4
    assert on_h100.tokens_per_s > 5 * on_l4.tokens_per_s
    assert 500 < on_h100.tokens_per_s < 5000  # the right order for 8B on one H100

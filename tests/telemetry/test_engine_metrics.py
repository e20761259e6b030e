"""Reading vLLM's /metrics, and quantiles and rates from samples."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.telemetry.engine_metrics import parse_engine_metrics
from controlplane.telemetry.histograms import bucket_delta, histogram_quantile
from controlplane.telemetry.models import ReplicaSample
from controlplane.telemetry.services import stats_between

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 5.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.5
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="llama"} 1000.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="llama"} 400.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="llama"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="llama"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama"} 2.0
"""


def test_parse_sums_engines_and_keeps_fullest_kv():
    snap = parse_engine_metrics(VLLM_TEXT)
    assert (snap.running, snap.waiting, snap.kv_usage) == (7.0, 3.0, 0.5)
    assert snap.counters == {"prompt_tokens": 1000.0, "generation_tokens": 400.0}
    assert snap.buckets["ttft"] == {"0.1": 2.0, "0.5": 8.0, "+Inf": 10.0}


@pytest.mark.parametrize(
    ("q", "buckets", "expected", "why"),
    [
        (0.5, {"0.1": 2, "0.5": 8, "+Inf": 10}, 0.1 + 0.4 * (5 - 2) / 6, "interpolates in bucket"),
        (0.95, {"0.1": 2, "0.5": 8, "+Inf": 10}, 0.5, "beyond the last finite bound: that bound"),
        (0.1, {"0.1": 2, "0.5": 8, "+Inf": 10}, 0.05, "first bucket starts at zero"),
        (0.5, {"0.1": 0, "+Inf": 0}, None, "no observations: no quantile"),
    ],
)
def test_histogram_quantile(q, buckets, expected, why):  # type: ignore[no-untyped-def]
    result = histogram_quantile(q, buckets)
    assert result == pytest.approx(expected) if expected is not None else result is None, why


def test_bucket_delta_handles_counter_reset():
    assert bucket_delta({"1": 5, "+Inf": 6}, {"1": 2, "+Inf": 2}) == {"1": 3, "+Inf": 4}
    assert bucket_delta({"1": 1, "+Inf": 1}, {"1": 2, "+Inf": 9}) == {"1": 1, "+Inf": 1}


def test_stats_between_two_samples():
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    older = ReplicaSample(at=t0, up=True, counters={"prompt_tokens": 100, "generation_tokens": 50},
                          buckets={"ttft": {"0.1": 1, "0.5": 1, "+Inf": 1}})
    newer = ReplicaSample(at=t0 + timedelta(seconds=10), up=True, running=4, waiting=1,
                          kv_usage=0.3, counters={"prompt_tokens": 600, "generation_tokens": 250},
                          buckets={"ttft": {"0.1": 1, "0.5": 11, "+Inf": 11}})
    stats = stats_between(newer, older)
    assert stats.prompt_tps == 50 and stats.generation_tps == 20
    assert stats.ttft_p95_s == pytest.approx(0.1 + 0.4 * 9.5 / 10)
    assert (stats.running, stats.waiting, stats.kv_usage) == (4, 1, 0.3)
    down = stats_between(ReplicaSample(at=t0, up=False, error="refused"), older)
    assert not down.up and down.error == "refused"


def test_stats_between_count_an_engine_restarted_in_between_from_zero():
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    older = ReplicaSample(at=t0, up=True, counters={"prompt_tokens": 900, "generation_tokens": 400},
                          buckets={"ttft": {"0.1": 3, "0.5": 8, "+Inf": 8}})
    newer = ReplicaSample(at=t0 + timedelta(seconds=10), up=True,
                          counters={"prompt_tokens": 300, "generation_tokens": 100},
                          buckets={"ttft": {"0.1": 0, "0.5": 10, "+Inf": 10}})
    stats = stats_between(newer, older)
    assert stats.prompt_tps == 30 and stats.generation_tps == 10
    assert stats.ttft_p95_s == pytest.approx(0.1 + 0.4 * 9.5 / 10)  # the newer buckets alone

"""The /metrics text: vLLM's names, labels and buckets, written exactly as prometheus_client
writes them, with histograms that take a batch of equal observations at once."""

from __future__ import annotations

import math

import pytest

from enginesim.metrics import (
    EngineMetrics,
    EngineState,
    Histogram,
    build_1_2_5_buckets,
    format_value,
)
from enginesim.scheduler import Sequence

STATE = EngineState(running=3, waiting=2, kv_cache_usage=0.25, prefix_cache_queries=1200,
                    prefix_cache_hits=640, preemptions=1, prompt_tokens=1200,
                    generation_tokens=77)


def populated() -> EngineMetrics:
    metrics = EngineMetrics("llama-3.1-8b", max_model_len=4096, created=1767225600.123)
    seq = Sequence(300, [], 16, None, arrival=10.0, ready_at=10.03, scheduled_at=10.05,
                   first_token_at=10.2, last_token_at=10.5, num_output=16,
                   finish_reason="length")
    metrics.first_token(seq, 0.2)
    metrics.inter_token(0.012, 15)
    metrics.step_tokens(316)
    metrics.finished(seq, 10.5)
    return metrics


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def test_the_text_is_what_prometheus_client_itself_would_write() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    from prometheus_client import CollectorRegistry, generate_latest

    text = populated().render(STATE).decode()

    class Replay:
        def collect(self):  # type: ignore[no-untyped-def]
            return parser.text_string_to_metric_families(text)

    registry = CollectorRegistry()
    registry.register(Replay())  # type: ignore[arg-type]
    assert generate_latest(registry).decode() == text


@pytest.mark.parametrize("name", [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
])
def test_each_series_vllm_exports_is_labelled_with_model_and_engine(name: str) -> None:
    series = samples(populated().render(STATE).decode())
    assert f'{name}{{engine="0",model_name="llama-3.1-8b"}}' in series


def test_values_come_from_the_engine_state_and_the_recorded_requests() -> None:
    series = samples(populated().render(STATE).decode())
    labels = '{engine="0",model_name="llama-3.1-8b"}'
    assert series["vllm:kv_cache_usage_perc" + labels] == 0.25
    assert series["vllm:prefix_cache_hits_total" + labels] == 640
    assert series["vllm:inter_token_latency_seconds_count" + labels] == 15
    assert series["vllm:inter_token_latency_seconds_sum" + labels] == pytest.approx(0.18)
    assert series["vllm:request_queue_time_seconds_sum" + labels] == pytest.approx(0.02)
    assert series["vllm:request_prefill_time_seconds_sum" + labels] == pytest.approx(0.15)
    assert series['vllm:request_success_total{engine="0",finished_reason="length",'
                  'model_name="llama-3.1-8b"}'] == 1
    assert series['vllm:request_success_total{engine="0",finished_reason="stop",'
                  'model_name="llama-3.1-8b"}'] == 0


def test_histogram_buckets_are_vllms() -> None:
    text = populated().render(STATE).decode()

    def bounds(name: str) -> list[str]:
        prefix = name + '_bucket{engine="0",le="'
        return [line[len(prefix):].split('"', 1)[0] for line in text.splitlines()
                if line.startswith(prefix)]

    assert bounds("vllm:time_to_first_token_seconds") == [
        "0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75",
        "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0",
        "+Inf"]
    assert bounds("vllm:inter_token_latency_seconds") == [
        "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75",
        "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf"]
    assert bounds("vllm:e2e_request_latency_seconds") == [
        "0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0",
        "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf"]
    assert bounds("vllm:request_prompt_tokens")[-2:] == ["2000.0", "+Inf"]


def test_a_batch_of_equal_observations_counts_once_per_observation() -> None:
    hist = Histogram([0.01, 0.02])
    hist.observe(0.015, 100)
    hist.observe(0.01)
    assert hist.count == 101 and hist.sum == pytest.approx(1.51)
    assert hist.cumulative() == [("0.01", 1), ("0.02", 101), ("+Inf", 101)]


def test_token_histograms_use_vllms_1_2_5_series_up_to_the_context() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4096)[-1] == 2000


@pytest.mark.parametrize(("value", "text"), [
    (0, "0.0"), (3, "3.0"), (0.25, "0.25"), (1767225600.123, "1.767225600123e+09"),
    (math.inf, "+Inf"), (1e-05, "1e-05")])
def test_values_are_written_as_prometheus_client_writes_them(value: float, text: str) -> None:
    assert format_value(value) == text

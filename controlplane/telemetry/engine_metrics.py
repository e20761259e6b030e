"""Reads a vLLM engine's /metrics text into one snapshot. Pure.

Only vLLM's own metric names are used (DESIGN §4), summed over label sets (engines with
several model names or engine indexes report one series each), so the same code reads the
real vLLM server and enginesim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
COUNTERS = {
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:request_success_total": "requests_ok",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds_bucket": "ttft",
    "vllm:inter_token_latency_seconds_bucket": "itl",
    "vllm:e2e_request_latency_seconds_bucket": "e2e",
}


@dataclass
class EngineSnapshot:
    """Gauges now, counters and cumulative histogram buckets since the engine started."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[str, float]] = field(default_factory=dict)


def parse_engine_metrics(text: str) -> EngineSnapshot:
    snapshot = EngineSnapshot()
    kv_seen = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name in GAUGES:
                attr = GAUGES[name]
                if attr == "kv_usage":
                    # Usage is a fraction per engine; report the fullest one.
                    snapshot.kv_usage = max(snapshot.kv_usage, sample.value)
                    kv_seen += 1
                else:
                    setattr(snapshot, attr, getattr(snapshot, attr) + sample.value)
            elif name in COUNTERS:
                key = COUNTERS[name]
                snapshot.counters[key] = snapshot.counters.get(key, 0.0) + sample.value
            elif name in HISTOGRAMS:
                le = sample.labels.get("le", "+Inf")
                series = snapshot.buckets.setdefault(HISTOGRAMS[name], {})
                series[le] = series.get(le, 0.0) + sample.value
    return snapshot

"""Every PromQL query Meridian runs, by name. Targets carry a `replica` label (file SD)."""

from __future__ import annotations

WINDOW = "{window}"
# rate() needs two samples inside its window: 2.5 × the shipped scrape interval (2 s).
MIN_WINDOW_S = 5

QUERIES: dict[str, str] = {
    "up": 'max by (replica) (up{job="meridian-replicas"})',
    "running": "sum by (replica) (vllm:num_requests_running)",
    "waiting": "sum by (replica) (vllm:num_requests_waiting)",
    "kv_usage": "max by (replica) (vllm:kv_cache_usage_perc)",
    "ttft_p95_s": (
        "histogram_quantile(0.95, sum by (replica, le) "
        f"(rate(vllm:time_to_first_token_seconds_bucket[{WINDOW}])))"
    ),
    "itl_p95_s": (
        "histogram_quantile(0.95, sum by (replica, le) "
        f"(rate(vllm:inter_token_latency_seconds_bucket[{WINDOW}])))"
    ),
    "prompt_tps": f"sum by (replica) (rate(vllm:prompt_tokens_total[{WINDOW}]))",
    "generation_tps": f"sum by (replica) (rate(vllm:generation_tokens_total[{WINDOW}]))",
}


def render(name: str, window_s: int) -> str:
    return QUERIES[name].replace(WINDOW, f"{max(window_s, MIN_WINDOW_S)}s")

"""vLLM's metrics, with its names, labels and histogram buckets (vllm/v1/metrics/loggers.py)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# vLLM exports no *_created series either.
disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LABELS = ("model_name", "engine")


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = {"model_name": model_name, "engine": "0"}
        self.running = Gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.", LABELS,
                             registry=r).labels(**labels)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be "
                             "processed.", LABELS, registry=r).labels(**labels)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent "
                              "usage.", LABELS, registry=r).labels(**labels)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in "
                                      "terms of number of queried tokens.", LABELS,
                                      registry=r).labels(**labels)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of "
                                   "number of cached tokens.", LABELS, registry=r).labels(**labels)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption "
                                   "from the engine.", LABELS, registry=r).labels(**labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens "
                                     "processed.", LABELS, registry=r).labels(**labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation "
                                         "tokens processed.", LABELS,
                                         registry=r).labels(**labels)
        self._success = Counter("vllm:request_success", "Count of successfully processed "
                                "requests.", (*LABELS, "finished_reason"), registry=r)
        self.success = {
            reason: self._success.labels(finished_reason=reason, **labels)
            for reason in ("stop", "length", "abort")
        }
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first "
                              "token in seconds.", LABELS, buckets=TTFT_BUCKETS,
                              registry=r).labels(**labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token "
                             "latency in seconds.", LABELS, buckets=ITL_BUCKETS,
                             registry=r).labels(**labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request "
                             "latency in seconds.", LABELS, buckets=E2E_BUCKETS,
                             registry=r).labels(**labels)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

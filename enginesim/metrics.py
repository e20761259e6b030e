"""vLLM's Prometheus metrics: the same names, help texts, labels and histogram buckets.

Names, documentation strings and buckets follow vllm/v1/metrics/loggers.py
(PrometheusStatLogger); every series carries the labels model_name (the served model name)
and engine (the engine index, "0" for a single engine), and request_success adds
finished_reason for each of vLLM's FinishReason values. The text is what prometheus_client
(which vLLM uses, with its default registry when one API server runs) writes: counters as
`<name>_total` with a `<name>_created` gauge family, histograms with `_bucket` (le last but
one, labels sorted), `_count`, `_sum` and `_created`.

The exposition is written here rather than through prometheus_client so that the hot path
stays cheap: a decode step observes one inter-token latency for a whole batch at once
(`Histogram.observe(value, count)`), and gauges and token counters are read from the
scheduler when /metrics is scraped instead of being updated every step.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from enginesim import scheduler as sched

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value, as vLLM sizes its token-count histograms."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


def format_value(value: float) -> str:
    """A sample value as prometheus_client's floatToGoString writes it."""
    value = float(value)
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


class Histogram:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        """Record `count` observations of `value` (a batch that saw the same latency)."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count
        self.count += count

    def cumulative(self) -> list[tuple[str, int]]:
        running = 0
        out = []
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append((format_value(bound), running))
        return out


@dataclass(frozen=True)
class EngineState:
    """What the scheduler reports at scrape time (vLLM's SchedulerStats plus counters)."""

    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    prompt_tokens: int
    generation_tokens: int


class EngineMetrics:
    """The request-level histograms and finish counters, fed by the scheduler's steps."""

    def __init__(self, model_name: str, max_model_len: int, engine_index: int = 0,
                 created: float | None = None) -> None:
        self.model_name = model_name
        self.engine = str(engine_index)
        self.created = time.time() if created is None else created
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
        self.request_max_tokens = Histogram(token_buckets)
        self.request_max_generation_tokens = Histogram(token_buckets)
        self.request_n = Histogram(N_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)

    # -- the scheduler's recorder --------------------------------------------------------------
    def first_token(self, seq: sched.Sequence, ttft: float) -> None:
        self.ttft.observe(ttft)

    def inter_token(self, latency: float, count: int) -> None:
        self.itl.observe(latency, count)

    def finished(self, seq: sched.Sequence, now: float) -> None:
        self.record_finish(seq, now)

    def step_tokens(self, tokens: int) -> None:
        self.iteration_tokens.observe(tokens)

    def record_finish(self, seq: sched.Sequence, now: float) -> None:
        reason = seq.finish_reason or "abort"
        self.success[reason] = self.success.get(reason, 0) + 1
        self.e2e.observe(now - seq.arrival)
        max_tokens_param = getattr(seq.payload, "max_tokens_param", None)
        if max_tokens_param:
            self.request_max_tokens.observe(max_tokens_param)
        self.request_n.observe(1)
        self.request_max_generation_tokens.observe(seq.max_tokens)
        self.request_prompt_tokens.observe(seq.prompt_len)
        self.request_generation_tokens.observe(seq.num_output)
        if seq.scheduled_at is None:
            return
        self.queue.observe(max(seq.scheduled_at - seq.ready_at, 0.0))
        first = seq.first_token_at
        last = seq.last_token_at
        if first is None or last is None:
            return
        self.prefill.observe(first - seq.scheduled_at)
        self.decode.observe(last - first)
        self.inference.observe(last - seq.scheduled_at)
        if seq.num_output > 1:
            self.tpot.observe((last - first) / (seq.num_output - 1))

    # -- exposition --------------------------------------------------------------------------
    def render(self, state: EngineState) -> bytes:
        labels = f'engine="{self.engine}",model_name="{_escape(self.model_name)}"'
        out: list[str] = []
        created = format_value(self.created)

        def gauge(name: str, doc: str, value: float) -> None:
            out.append(f"# HELP {name} {doc}\n# TYPE {name} gauge\n"
                       f"{name}{{{labels}}} {format_value(value)}\n")

        def counter(name: str, doc: str, series: Iterable[tuple[str, float]]) -> None:
            series = list(series)
            out.append(f"# HELP {name}_total {doc}\n# TYPE {name}_total counter\n")
            out.extend(f"{name}_total{{{lab}}} {format_value(v)}\n" for lab, v in series)
            out.append(f"# HELP {name}_created {doc}\n# TYPE {name}_created gauge\n")
            out.extend(f"{name}_created{{{lab}}} {created}\n" for lab, _ in series)

        def histogram(name: str, doc: str, hist: Histogram) -> None:
            out.append(f"# HELP {name} {doc}\n# TYPE {name} histogram\n")
            out.extend(f'{name}_bucket{{engine="{self.engine}",le="{le}",model_name='
                       f'"{_escape(self.model_name)}"}} {format_value(n)}\n'
                       for le, n in hist.cumulative())
            out.append(f"{name}_count{{{labels}}} {format_value(hist.count)}\n"
                       f"{name}_sum{{{labels}}} {format_value(hist.sum)}\n"
                       f"# HELP {name}_created {doc}\n# TYPE {name}_created gauge\n"
                       f"{name}_created{{{labels}}} {created}\n")

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              state.running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              state.waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              state.kv_cache_usage)
        counter("vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                [(labels, state.prefix_cache_queries)])
        counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                "tokens.", [(labels, state.prefix_cache_hits)])
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                [(labels, state.preemptions)])
        counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                [(labels, state.prompt_tokens)])
        counter("vllm:generation_tokens", "Number of generation tokens processed.",
                [(labels, state.generation_tokens)])
        counter("vllm:request_success", "Count of successfully processed requests.",
                [(f'engine="{self.engine}",finished_reason="{reason}",model_name='
                  f'"{_escape(self.model_name)}"', n) for reason, n in self.success.items()])
        histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                  self.request_prompt_tokens)
        histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                  self.request_generation_tokens)
        histogram("vllm:iteration_tokens_total",
                  "Histogram of number of tokens per engine_step.", self.iteration_tokens)
        histogram("vllm:request_max_num_generation_tokens",
                  "Histogram of maximum number of requested generation tokens.",
                  self.request_max_generation_tokens)
        histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                  self.request_n)
        histogram("vllm:request_params_max_tokens",
                  "Histogram of the max_tokens request parameter.", self.request_max_tokens)
        histogram("vllm:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds.", self.ttft)
        histogram("vllm:inter_token_latency_seconds",
                  "Histogram of inter-token latency in seconds.", self.itl)
        histogram("vllm:request_time_per_output_token_seconds",
                  "Histogram of time_per_output_token_seconds per request.", self.tpot)
        histogram("vllm:e2e_request_latency_seconds",
                  "Histogram of e2e request latency in seconds.", self.e2e)
        histogram("vllm:request_queue_time_seconds",
                  "Histogram of time spent in WAITING phase for request.", self.queue)
        histogram("vllm:request_inference_time_seconds",
                  "Histogram of time spent in RUNNING phase for request.", self.inference)
        histogram("vllm:request_prefill_time_seconds",
                  "Histogram of time spent in PREFILL phase for request.", self.prefill)
        histogram("vllm:request_decode_time_seconds",
                  "Histogram of time spent in DECODE phase for request.", self.decode)
        return "".join(out).encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
